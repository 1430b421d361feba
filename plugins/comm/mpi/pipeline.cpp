// The pipelined all_reduce: every rank of the communicator is on this node
// and maps one POSIX shared-memory segment, made when the communicator is.
// Cross-memory attach (shared_memory.cpp) copies through the kernel at about
// half of memcpy's speed here and always touches user memory on both sides;
// this path moves each byte with plain loads and stores through slots small
// enough to stay in the caches (L2 and the shared L3), so only each rank's
// own send and recv go to DRAM.
//
// The buffer is cut into pieces of `ranks` sub-ranges of `share` elements
// (share_bytes() picks their size per call); sub-range q of every piece is
// owned by rank q. Rank r first copies its input of every sub-range but its
// own of piece 0 into its slot (copy-in) and publishes `in`. Then step p:
//   1. waits until every peer's `in` covers piece p and its `out` piece
//      p - 1, and until the slot of piece p + 1 is free;
//   2. reduces its own sub-range of piece p, its send and then each peer's
//      slot in rotation, into its own slot and into its recv; copies in
//      piece p + 1; copies each peer's result of piece p - 1 out of the
//      peer's slot into its recv (on two ranks all in one loop,
//      reduce_two_lines);
//   3. publishes `out` for piece p, `in` for piece p + 1 and `done` for
//      piece p - 1.
// So peers reduce a piece while this rank still copies the one before out.
// Every result is computed once, by its owner, so every rank gets the same
// bits. A rank's slots form a ring of kSlots; before copying into a slot it
// waits until every rank's `done` shows the piece that last used it
// consumed. Results of buffers of at least MESHRUN_MPI_STREAM_MIN_BYTES go
// into recv with non-temporal stores (see kDefaultStreamMinBytes).
//
// Memory ordering: each counter has one writer, which stores the piece's
// sequence number with release after its plain stores into its slot (for
// `in` and `out`) or after its plain loads from peers' slots (for `done`);
// the readers load it with acquire before touching the slot. So a reduction
// sees the complete copy-in, a copy-out sees the complete result, and a
// copy-in into a reused slot cannot overtake the reads of the piece before
// (the peer's loads happen before its release of `done`, which happens
// before our acquire of it and hence before our stores). The counters only
// grow: sequence numbers run on across calls (`next`, advanced identically on
// every rank because ranks issue a communicator's collectives in the same
// order), so no reset is needed between calls and a rank may return as soon
// as its recv is complete; nobody ever touches another rank's user memory.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "collectives.hpp"
#include "meshrun/plugin.hpp"
#include "nontemporal.hpp"
#include "segment.hpp"

namespace meshrun::mpi::pipeline {
namespace {

using meshrun::plugin::Error;

// Every buffer is cut into at least this many pieces (unless a piece would
// fall under kMinPieceBytes), so that one piece's copy-in overlaps another's
// copy-out even in the smallest buffers the pipeline takes.
constexpr size_t kMinPieces = 16;
constexpr size_t kMinPieceBytes = size_t{256} << 10;

// Buffers this large are written into recv with non-temporal stores. Plain
// stores first read every line of recv from memory (a read for ownership),
// so a rank moved three bytes through DRAM per byte of its buffer (send
// read, recv read and written back) instead of two. Measured on 2 ranks
// here, with the owner's result streamed in the same pass as its reduction:
// 4 to 16 MiB all_reduces 15-25% faster, 64 and 256 MiB 20-30%. So the
// default streams every buffer the pipeline takes; a caller that reads a
// few MiB of results at once may do better with them left in the caches.
// Only this rank's stores depend on it, so ranks may differ.
constexpr size_t kDefaultStreamMinBytes = size_t{4} << 20;

size_t stream_min_bytes() {
  static const size_t bytes =
      bytes_from_environment("MESHRUN_MPI_STREAM_MIN_BYTES", kDefaultStreamMinBytes);
  return bytes;
}

// Bytes of every rank's share of a piece, for a buffer of `bytes` and slots
// of `slot_bytes`: pieces of a kMinPieces-th of the buffer, at least
// kMinPieceBytes and at most a slot, shares in whole cache lines. The same
// on every rank, since it depends only on what they share.
size_t share_bytes(size_t bytes, size_t slot_bytes, int ranks) {
  const size_t piece = std::min(std::max(bytes / kMinPieces, kMinPieceBytes), slot_bytes);
  const size_t share = piece / static_cast<size_t>(ranks);
  return std::max(share / kLineBytes, size_t{1}) * kLineBytes;
}

// Elements [first, first + count) of the buffer.
struct Range {
  size_t first;
  size_t count;
};

// One all_reduce through the segment. Step p reduces this rank's sub-range
// of piece p, copies in piece p + 1 and copies out the peers' results of
// piece p - 1: on two ranks in one loop (reduce_two_lines) where the
// buffers allow, otherwise one after the other.
class Call {
 public:
  Call(const Comm& comm, Segment& segment, Scratch& scratch, const Buffers& buffers, ReduceOp op)
      : comm_(comm),
        segment_(segment),
        buffers_(buffers),
        op_(op),
        element_(element_bytes(buffers.dtype)),
        region_bytes_(segment.slot_bytes() / static_cast<size_t>(comm.size)),
        share_(share_bytes(buffers.count * element_, segment.slot_bytes(), comm.size) / element_),
        piece_(share_ * static_cast<size_t>(comm.size)),
        pieces_((buffers.count + piece_ - 1) / piece_),
        first_sequence_(segment.next_piece),
        stream_(buffers.count * element_ >= stream_min_bytes()),
        // Every sub-range starts a whole number of lines into recv, so one
        // test covers the non-temporal stores of every step. A misaligned
        // recv is written in separate passes: shifting every range by its
        // head in one loop would split the slots' loads and stores across
        // lines, which ran 10% slower than the passes.
        fused_(!stream_ || line_aligned(buffers.recv)),
        acc_(sized(scratch.accumulator, share_ * accumulator_bytes(buffers.dtype))),
        waiter_(comm, segment) {
    segment.next_piece += pieces_;
  }

  void run() {
    await_slot(0);
    copy_in(0);
    publish(&Published::in, sequence(0) + 1);
    for (uint64_t p = 0; p <= pieces_; ++p) step(p);
    // The caller may read recv as soon as the engine reports completion.
    if (stream_) stream_fence();
  }

 private:
  // A byte range to copy, as the step gathers them.
  struct Copy {
    std::byte* dst;
    const std::byte* src;
    size_t bytes;
    bool stream;
  };

  void step(uint64_t p) {
    const bool reducing = p < pieces_;
    const bool copying_in = p + 1 < pieces_;
    const bool copying_out = p > 0;
    for (int distance = 1; distance < comm_.size; ++distance) {
      const int q = peer_at(comm_, distance);
      if (reducing) waiter_.await(q, &Published::in, sequence(p) + 1);
      if (copying_out) waiter_.await(q, &Published::out, sequence(p - 1) + 1);
    }
    if (copying_in) await_slot(p + 1);
    copies_.clear();
    if (copying_in) add_copies_in(p + 1);
    if (copying_out) add_copies_out(p - 1);
    const Range own = reducing ? range(p, comm_.rank) : Range{0, 0};
    // Whole lines in one loop, the rest in separate passes.
    const size_t lines = fused_lines(own);
    if (lines > 0) reduce_fused(p, own, lines);
    do_apart(p, own, lines * kLineBytes);
    if (reducing) publish(&Published::out, sequence(p) + 1);
    if (copying_in) publish(&Published::in, sequence(p + 1) + 1);
    if (copying_out) publish(&Published::done, sequence(p - 1) + 1);
  }

  // The whole lines that the reduction and both copies of a two-rank step
  // (one in, one out) have; 0 for any other step.
  size_t fused_lines(Range own) const {
    if (!fused_ || comm_.size != 2 || own.count == 0 || copies_.size() != 2) return 0;
    size_t lines = own.count * element_ / kLineBytes;
    for (const Copy& copy : copies_) lines = std::min(lines, copy.bytes / kLineBytes);
    return lines;
  }

  // This rank's result of piece p and every copy from byte `from` on, each
  // in a pass of its own.
  void do_apart(uint64_t p, Range own, size_t from) {
    const size_t own_bytes = own.count * element_;
    if (own_bytes > from) reduce_own(p, own, from / element_, (own_bytes - from) / element_);
    for (const Copy& copy : copies_) {
      if (copy.bytes > from) copy_bytes(copy, from, copy.bytes - from);
    }
  }

  // The first `lines` lines of this rank's result of piece p, of its
  // copy-in and of its copy-out, in one loop.
  void reduce_fused(uint64_t p, Range own, size_t lines) {
    const size_t first = own.first * element_;
    reduce_two_lines(buffers_.dtype, op_, buffers_.send + first,
                     region(peer_at(comm_, 1), p, comm_.rank),
                     {region(comm_.rank, p, comm_.rank), buffers_.recv + first, stream_}, lines,
                     {copies_[0].dst, copies_[0].src}, {copies_[1].dst, copies_[1].src});
  }

  // `count` elements of this rank's result of piece p from element `from` of
  // its sub-range: into its slot and into recv.
  void reduce_own(uint64_t p, Range own, size_t from, size_t count) {
    const auto peer_input = [&](int distance) -> const void* {
      return region(peer_at(comm_, distance), p, comm_.rank) + from * element_;
    };
    const size_t first = own.first + from;
    reduce(buffers_.dtype, op_, comm_.size, buffers_.send + first * element_, peer_input, acc_,
           {region(comm_.rank, p, comm_.rank) + from * element_, buffers_.recv + first * element_,
            stream_},
           count);
  }

  // Every peer's sub-range of piece p, from send into this rank's slot.
  void add_copies_in(uint64_t p) {
    for (int distance = 1; distance < comm_.size; ++distance) {
      const int q = peer_at(comm_, distance);
      const Range part = range(p, q);
      if (part.count == 0) continue;
      copies_.push_back({region(comm_.rank, p, q), buffers_.send + part.first * element_,
                         part.count * element_, false});
    }
  }

  // Every peer's result of piece p, from the peer's slot into recv.
  void add_copies_out(uint64_t p) {
    for (int distance = 1; distance < comm_.size; ++distance) {
      const int q = peer_at(comm_, distance);
      const Range theirs = range(p, q);
      if (theirs.count == 0) continue;
      copies_.push_back({buffers_.recv + theirs.first * element_, region(q, p, q),
                         theirs.count * element_, stream_});
    }
  }

  void copy_in(uint64_t p) {
    copies_.clear();
    add_copies_in(p);
    for (const Copy& copy : copies_) copy_bytes(copy, 0, copy.bytes);
  }

  // `bytes` bytes of `copy` from byte `from` on.
  static void copy_bytes(const Copy& copy, size_t from, size_t bytes) {
    if (copy.stream) {
      stream_copy(copy.dst + from, copy.src + from, bytes);
    } else {
      std::memcpy(copy.dst + from, copy.src + from, bytes);
    }
  }

  // Waits until every rank has read the piece that last used the slot of
  // piece p.
  void await_slot(uint64_t p) {
    if (sequence(p) < kSlots) return;
    for (int q = 0; q < comm_.size; ++q) {
      waiter_.await(q, &Published::done, sequence(p) + 1 - kSlots);
    }
  }

  // The sub-range of piece p that `owner` reduces.
  Range range(uint64_t p, int owner) const {
    const size_t begin = std::min(p * piece_ + static_cast<size_t>(owner) * share_, buffers_.count);
    return Range{begin, std::min(share_, buffers_.count - begin)};
  }

  uint64_t sequence(uint64_t p) const { return first_sequence_ + p; }

  // Where `owner`'s sub-range of piece p lives in `rank`'s slot.
  std::byte* region(int rank, uint64_t p, int owner) {
    return segment_.slot(rank, sequence(p)) + static_cast<size_t>(owner) * region_bytes_;
  }

  void publish(Counter Published::*counter, uint64_t value) {
    segment_.publish(comm_.rank, counter, value);
  }

  const Comm& comm_;
  Segment& segment_;
  const Buffers& buffers_;
  const ReduceOp op_;
  const size_t element_;
  const size_t region_bytes_;
  const size_t share_;
  const size_t piece_;
  const uint64_t pieces_;
  const uint64_t first_sequence_;
  const bool stream_;
  const bool fused_;
  std::byte* const acc_;
  Waiter waiter_;
  // The step's copies (copy-ins first), kept to reuse their memory.
  std::vector<Copy> copies_;
};

}  // namespace

void all_reduce(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op) {
  Segment& segment = *comm.segment;
  if (segment.broken) {
    throw Error(MESHRUN_FAILED_PRECONDITION,
                "an earlier all_reduce on this communicator failed midway, leaving its ranks out "
                "of step; the communicator cannot be used for large all_reduces any more");
  }
  Call(comm, segment, scratch, buffers, op).run();
}

}  // namespace meshrun::mpi::pipeline
