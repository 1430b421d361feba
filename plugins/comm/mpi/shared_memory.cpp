// The shared-memory path: every rank of the communicator is on this node, so
// ranks read and write each other's buffers directly with process_vm_readv
// and process_vm_writev (one copy, no staging through MPI). The ranks meet
// in the communicator's segment (segment.hpp): each publishes its buffers'
// addresses as it enters a collective (`arrive`) and says when it is done
// with the others' (`leave`); a late peer is waited for asleep, not spinning.
//
// The rule that makes this safe: a rank touches a peer's buffer only while
// the peer is inside the same collective (between its arrival and its
// leaving), each region of a buffer has one writer and is not read while it
// is written, and no rank returns (and may reuse or free its buffers) before
// every peer has left, which also keeps a peer from publishing the next
// collective's addresses while this one's are still read.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "collectives.hpp"
#include "meshrun/plugin.hpp"
#include "remote_memory.hpp"
#include "segment.hpp"

namespace meshrun::mpi::shared_memory {
namespace {

// Reductions go through the caches in pieces this large: the accumulator and
// the piece read from a peer stay in L2 while they are combined.
constexpr size_t kPieceBytes = size_t{256} << 10;

// Where one rank's buffers of this collective live in its address space.
struct Endpoint {
  uint64_t send;
  uint64_t recv;
};

// The communicator's segment, unless an earlier collective broke it.
Segment& usable_segment(const Comm& comm) {
  if (comm.segment->broken) {
    throw meshrun::plugin::Error(
        MESHRUN_FAILED_PRECONDITION,
        "an earlier collective on this communicator failed midway, leaving its ranks out of "
        "step; its shared-memory collectives cannot be used any more");
  }
  return *comm.segment;
}

// One collective's meeting in the segment: entered on construction, left
// with leave(), which waits for every peer to leave too.
class Meeting {
 public:
  // Publishes this rank's buffers and waits for every peer's.
  Meeting(const Comm& comm, const void* send, const void* recv)
      : comm_(comm), segment_(usable_segment(comm)), waiter_(comm, segment_) {
    number_ = ++segment_.last_collective;
    Published& mine = segment_.of(comm.rank);
    mine.addresses.send.store(reinterpret_cast<uint64_t>(send), std::memory_order_relaxed);
    mine.addresses.recv.store(reinterpret_cast<uint64_t>(recv), std::memory_order_relaxed);
    segment_.publish(comm.rank, &Published::arrive, number_);
    peers_.resize(static_cast<size_t>(comm.size));
    for (int q = 0; q < comm.size; ++q) {
      if (q != comm.rank) waiter_.await(q, &Published::arrive, number_);
      const Published& theirs = segment_.of(q);
      peers_[static_cast<size_t>(q)] = {theirs.addresses.send.load(std::memory_order_relaxed),
                                        theirs.addresses.recv.load(std::memory_order_relaxed)};
    }
  }

  // A meeting not left (an error midway) leaves the ranks' counters out of
  // step for good.
  ~Meeting() {
    if (!left_) segment_.broken = true;
  }
  Meeting(const Meeting&) = delete;
  Meeting& operator=(const Meeting&) = delete;

  const std::vector<Endpoint>& peers() const { return peers_; }

  // Says this rank is done with the peers' buffers and waits until every
  // peer is done with this rank's.
  void leave() {
    segment_.publish(comm_.rank, &Published::leave, number_);
    for (int q = 0; q < comm_.size; ++q) {
      if (q != comm_.rank) waiter_.await(q, &Published::leave, number_);
    }
    left_ = true;
  }

 private:
  const Comm& comm_;
  Segment& segment_;
  Waiter waiter_;
  uint64_t number_ = 0;
  std::vector<Endpoint> peers_;
  bool left_ = false;
};

pid_t pid_of(const Comm& comm, int rank) { return comm.pids[static_cast<size_t>(rank)]; }

// The elements [first, first + count) of `total` that `rank` reduces: an
// even split, the last rank taking the remainder.
struct Range {
  size_t first;
  size_t count;
};

Range owned(size_t total, int ranks, int rank) {
  const size_t share = total / static_cast<size_t>(ranks);
  const size_t first = share * static_cast<size_t>(rank);
  return {first, rank == ranks - 1 ? total - first : share};
}

// dst = op over the ranks of `count` elements at element `first` of every
// rank's send buffer: this rank's elements, then each peer's as it is read.
// `dst` may be this rank's own elements (in place).
void reduce_piece(const Comm& comm, Scratch& scratch, const std::vector<Endpoint>& peers,
                  const Buffers& buffers, size_t first, size_t count, ReduceOp op, std::byte* dst) {
  const Dtype dtype = buffers.dtype;
  const size_t offset = first * element_bytes(dtype);
  const size_t bytes = count * element_bytes(dtype);
  std::byte* incoming = sized(scratch.incoming, bytes);
  std::byte* acc = sized(scratch.accumulator, count * accumulator_bytes(dtype));
  const auto read_peer = [&](int step) -> const void* {
    const int q = peer_at(comm, step);
    read_remote(pid_of(comm, q), peers[static_cast<size_t>(q)].send + offset, incoming, bytes);
    return incoming;
  };
  reduce(dtype, op, comm.size, buffers.send + offset, read_peer, acc, {dst}, count);
}

}  // namespace

// Rank r owns chunk r of the elements: piece by piece, it reads chunk r of
// every peer's send, reduces it into its own recv, and writes the result
// into every peer's recv. Each rank reads every input once and writes every
// output once; leaving the meeting ends the collective.
//
// In place (send == recv on every rank) this is safe because chunk r of any
// rank's buffer is touched by rank r alone: it reads a piece of it from
// every rank before it writes that piece's result to any of them.
void all_reduce(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op) {
  const size_t bytes = element_bytes(buffers.dtype);
  Meeting meeting(comm, buffers.send, buffers.recv);
  const std::vector<Endpoint>& peers = meeting.peers();
  const Range mine = owned(buffers.count, comm.size, comm.rank);
  const size_t piece = kPieceBytes / accumulator_bytes(buffers.dtype);
  for (size_t done = 0; done < mine.count; done += piece) {
    const size_t count = std::min(piece, mine.count - done);
    const size_t offset = (mine.first + done) * bytes;
    std::byte* result = buffers.recv + offset;
    reduce_piece(comm, scratch, peers, buffers, mine.first + done, count, op, result);
    for (int step = 1; step < comm.size; ++step) {
      const int q = peer_at(comm, step);
      write_remote(pid_of(comm, q), peers[static_cast<size_t>(q)].recv + offset, result,
                   count * bytes);
    }
  }
  meeting.leave();
}

// Every rank copies its send into its mailbox and, once every rank has,
// reduces all the mailboxes in rank order into its recv: every rank computes
// the same bits, in one meeting without a departure. A rank reuses a
// mailbox two collectives later, and by then every peer has entered the
// collective in between, so has finished reading it.
void all_reduce_small(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op) {
  Segment& segment = usable_segment(comm);
  const uint64_t number = ++segment.last_collective;
  std::memcpy(segment.mailbox(comm.rank, number), buffers.send,
              buffers.count * element_bytes(buffers.dtype));
  segment.publish(comm.rank, &Published::arrive, number);
  Waiter waiter(comm, segment);
  for (int q = 0; q < comm.size; ++q) {
    if (q != comm.rank) waiter.await(q, &Published::arrive, number);
  }
  std::byte* acc = sized(scratch.accumulator, buffers.count * accumulator_bytes(buffers.dtype));
  reduce(
      buffers.dtype, op, comm.size, segment.mailbox(0, number),
      [&](int q) -> const void* { return segment.mailbox(q, number); }, acc, {buffers.recv},
      buffers.count);
}

// Every rank copies every peer's send into its recv slot. A send that
// overlaps the recv (in place) is first copied aside, so that what peers read
// is never overwritten by what this rank receives.
void all_gather(const Comm& comm, Scratch& scratch, const Buffers& buffers) {
  const size_t bytes = buffers.count * element_bytes(buffers.dtype);
  const size_t ranks = static_cast<size_t>(comm.size);
  const std::byte* send = buffers.send;
  if (overlaps(send, bytes, buffers.recv, bytes * ranks)) {
    send = static_cast<std::byte*>(std::memcpy(sized(scratch.staged, bytes), send, bytes));
  }
  Meeting meeting(comm, send, buffers.recv);
  const std::vector<Endpoint>& peers = meeting.peers();
  std::memcpy(buffers.recv + static_cast<size_t>(comm.rank) * bytes, send, bytes);
  for (int step = 1; step < comm.size; ++step) {
    const int q = peer_at(comm, step);
    read_remote(pid_of(comm, q), peers[static_cast<size_t>(q)].send,
                buffers.recv + static_cast<size_t>(q) * bytes, bytes);
  }
  meeting.leave();
}

// Rank r reduces chunk r of everyone's send. A recv that overlaps the send
// (in place) is written only after leaving, once no peer reads the send any
// more; otherwise leaving only keeps the send alive for the peers.
void reduce_scatter(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op) {
  const size_t bytes = element_bytes(buffers.dtype);
  const size_t chunk_bytes = buffers.count * bytes;
  const bool in_place = overlaps(buffers.send, chunk_bytes * static_cast<size_t>(comm.size),
                                 buffers.recv, chunk_bytes);
  std::byte* dst = in_place ? sized(scratch.staged, chunk_bytes) : buffers.recv;
  Meeting meeting(comm, buffers.send, buffers.recv);
  const std::vector<Endpoint>& peers = meeting.peers();
  const size_t first = static_cast<size_t>(comm.rank) * buffers.count;
  const size_t piece = kPieceBytes / accumulator_bytes(buffers.dtype);
  for (size_t done = 0; done < buffers.count; done += piece) {
    const size_t count = std::min(piece, buffers.count - done);
    reduce_piece(comm, scratch, peers, buffers, first + done, count, op, dst + done * bytes);
  }
  meeting.leave();
  if (in_place) std::memcpy(buffers.recv, dst, chunk_bytes);
}

// Every rank but the root copies the root's tensor.
void broadcast(const Comm& comm, const Buffers& buffers, int root) {
  Meeting meeting(comm, buffers.recv, buffers.recv);
  const std::vector<Endpoint>& peers = meeting.peers();
  if (comm.rank != root) {
    read_remote(pid_of(comm, root), peers[static_cast<size_t>(root)].recv, buffers.recv,
                buffers.count * element_bytes(buffers.dtype));
  }
  meeting.leave();
}

}  // namespace meshrun::mpi::shared_memory
