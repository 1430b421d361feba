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
// owned by rank q. Per piece, rank r:
//   1. copies its input of every sub-range but its own into its slot
//      (copy-in) and publishes `in`;
//   2. once every peer's `in` covers the piece, reduces its own sub-range:
//      its send, then each peer's slot in rotation, the result into its own
//      slot and, in the same pass, into its recv, and publishes `out`;
//   3. copies in the next piece, so that peers can reduce it while this rank
//      still copies out, and
//   4. copies each peer's result out of the peer's slot into its recv once
//      the peer's `out` covers the piece, then publishes `done`.
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
#include "pipeline.hpp"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "collectives.hpp"
#include "meshrun/plugin.hpp"
#include "nontemporal.hpp"

namespace meshrun::mpi::pipeline {
namespace {

using meshrun::plugin::Error;

// Slots per rank: a rank may copy in up to kSlots - 1 pieces ahead of the
// slowest peer's copy-out, which absorbs a peer being descheduled briefly.
constexpr uint64_t kSlots = 4;
// Bytes of one slot, split among the ranks: the largest piece. On 2 ranks
// here 2 MiB pieces ran 64 and 256 MiB all_reduces 8-10% faster than 256 KiB
// ones: fewer hand-overs, and a peer's result has mostly left the writer's
// L2 for the shared L3 by the time it is read, which is cheaper than a
// snoop. The slots of every rank (16 MiB on 2 ranks) still sit in the L3.
constexpr size_t kDefaultSlotBytes = size_t{2} << 20;
// Every buffer is cut into at least this many pieces (unless a piece would
// fall under kMinPieceBytes), so that one piece's copy-in overlaps another's
// copy-out even in the smallest buffers the pipeline takes.
constexpr size_t kMinPieces = 16;
constexpr size_t kMinPieceBytes = size_t{256} << 10;
// A segment takes at most this fraction of the free space of the file
// system behind shm_open (/dev/shm): its pages are allocated as they are
// first touched, and a touch beyond a full tmpfs kills the process with
// SIGBUS, so small /dev/shm mounts (64 MiB in a default container) get
// smaller slots instead.
constexpr size_t kShmShareDivisor = 16;
// Pause-spins before a waiting rank starts yielding its core: long enough to
// catch a peer that is a few microseconds behind, short enough that ranks
// oversubscribing the cores hand them over quickly.
constexpr uint32_t kSpins = 512;
// Waits look at the clock (and at whether the peer still lives) this often.
constexpr uint32_t kCheckEvery = 1024;

// A counter alone on its cache line: one rank stores, the others poll, and
// no store of another counter disturbs the line. Lock-free atomics are
// address-free, so they work between processes that map them at different
// addresses.
struct alignas(kLineBytes) Counter {
  std::atomic<uint64_t> value{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// What one rank publishes: the sequence number + 1 of the last piece whose
// inputs (`in`) or result (`out`) are in its slot, and of the last piece it
// has finished reading from every slot (`done`).
struct Published {
  Counter in;
  Counter out;
  Counter done;
};

// What rank 0 tells the others about the segment.
struct Announcement {
  char name[64];  // empty: rank 0 could not make it
  uint64_t slot_bytes;
};

size_t mapped_bytes(int ranks, size_t slot_bytes) {
  const size_t header = (sizeof(Published) * static_cast<size_t>(ranks) + 4095) & ~size_t{4095};
  return header + static_cast<size_t>(ranks) * kSlots * slot_bytes;
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", seconds);
  return text;
}

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

void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

// A mapped segment: rank r's counters, then its kSlots slots.
class Segment {
 public:
  Segment(void* base, int ranks, size_t slot_bytes, std::vector<int> world_ranks)
      : base_(static_cast<std::byte*>(base)),
        bytes_(mapped_bytes(ranks, slot_bytes)),
        slots_(base_ + bytes_ - static_cast<size_t>(ranks) * kSlots * slot_bytes),
        slot_bytes_(slot_bytes),
        world_ranks_(std::move(world_ranks)) {}
  ~Segment() { munmap(base_, bytes_); }
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  Published& of(int rank) { return reinterpret_cast<Published*>(base_)[rank]; }
  std::byte* slot(int rank, uint64_t sequence) {
    return slots_ + (static_cast<size_t>(rank) * kSlots + sequence % kSlots) * slot_bytes_;
  }
  size_t slot_bytes() const { return slot_bytes_; }
  int world_rank(int rank) const { return world_ranks_[static_cast<size_t>(rank)]; }

  // The sequence number of the next piece.
  uint64_t next = 0;
  // Set when a call gave up midway: the ranks' counters no longer agree on
  // where the next call starts.
  bool broken = false;

 private:
  std::byte* base_;
  size_t bytes_;
  std::byte* slots_;
  size_t slot_bytes_;
  std::vector<int> world_ranks_;
};

namespace {

// The slot size for `ranks` ranks: MESHRUN_MPI_PIPELINE_SLOT_BYTES (default
// kDefaultSlotBytes), halved until the segment fits its share of the free
// space behind `fd`; every rank's share of a slot is whole cache lines.
size_t fitting_slot_bytes(int fd, size_t ranks) {
  size_t share =
      std::max(bytes_from_environment("MESHRUN_MPI_PIPELINE_SLOT_BYTES", kDefaultSlotBytes) /
                   (ranks * kLineBytes),
               size_t{1});
  struct statvfs space {};
  if (fstatvfs(fd, &space) == 0) {
    const size_t free_bytes = static_cast<size_t>(space.f_bavail) * space.f_frsize;
    while (share > 1 &&
           mapped_bytes(static_cast<int>(ranks), share * ranks * kLineBytes) * kShmShareDivisor >
               free_bytes) {
      share /= 2;
    }
  }
  return share * ranks * kLineBytes;
}

}  // namespace

std::shared_ptr<Segment> make_segment(const Comm& comm) {
  static unsigned made = 0;  // engine thread only
  Announcement announced{};
  const size_t ranks = static_cast<size_t>(comm.size);
  void* base = MAP_FAILED;
  if (comm.rank == 0) {
    std::snprintf(announced.name, sizeof announced.name, "/meshrun-%d-%u",
                  static_cast<int>(getpid()), made++);
    const int fd = shm_open(announced.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    const size_t slot_bytes = fd >= 0 ? fitting_slot_bytes(fd, ranks) : 0;
    announced.slot_bytes = slot_bytes;
    const size_t bytes = mapped_bytes(comm.size, slot_bytes);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
      base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    if (fd >= 0) close(fd);
    if (base == MAP_FAILED) {
      if (fd >= 0) shm_unlink(announced.name);
      announced.name[0] = '\0';
    } else {
      new (base) Published[ranks];
    }
  }
  check_mpi(MPI_Bcast(&announced, sizeof announced, MPI_BYTE, 0, comm.comm), "MPI_Bcast");
  if (comm.rank != 0 && announced.name[0] != '\0') {
    const int fd = shm_open(announced.name, O_RDWR, 0);
    if (fd >= 0) {
      base = mmap(nullptr, mapped_bytes(comm.size, announced.slot_bytes), PROT_READ | PROT_WRITE,
                  MAP_SHARED, fd, 0);
      close(fd);
    }
  }
  int mapped = base == MAP_FAILED ? 0 : 1;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &mapped, 1, MPI_INT, MPI_MIN, comm.comm), "MPI_Allreduce");
  // Every rank has opened the object (or given up) once past the reduction:
  // the name is no longer needed, and the memory lives until the last unmap.
  if (comm.rank == 0 && announced.name[0] != '\0') shm_unlink(announced.name);
  std::vector<int> world_ranks(ranks);
  check_mpi(MPI_Allgather(&comm.world_rank, 1, MPI_INT, world_ranks.data(), 1, MPI_INT, comm.comm),
            "MPI_Allgather");
  if (mapped == 0) {
    if (base != MAP_FAILED) munmap(base, mapped_bytes(comm.size, announced.slot_bytes));
    return nullptr;
  }
  return std::make_shared<Segment>(base, comm.size, announced.slot_bytes, std::move(world_ranks));
}

namespace {

// Waits for peers' counters, within the communicator's timeout.
class Waiter {
 public:
  Waiter(const Comm& comm, Segment& segment) : comm_(comm), segment_(segment) {}

  // Returns once `rank`'s `counter` (of segment.of(rank)) reaches `target`.
  void await(int rank, Counter Published::*counter, uint64_t target) {
    const std::atomic<uint64_t>& value = (segment_.of(rank).*counter).value;
    if (value.load(std::memory_order_acquire) >= target) return;
    const auto start = std::chrono::steady_clock::now();
    for (uint32_t polls = 1;; ++polls) {
      if (polls < kSpins) {
        relax();
      } else {
        sched_yield();
      }
      if (value.load(std::memory_order_acquire) >= target) return;
      if (polls % kCheckEvery == 0) check(rank, start);
    }
  }

 private:
  void check(int rank, std::chrono::steady_clock::time_point start) {
    const pid_t pid = comm_.pids[static_cast<size_t>(rank)];
    const std::string peer = "rank " + std::to_string(rank) + " (world rank " +
                             std::to_string(segment_.world_rank(rank));
    if (kill(pid, 0) != 0 && errno == ESRCH) {
      segment_.broken = true;
      throw Error(MESHRUN_UNAVAILABLE, peer + ", pid " + std::to_string(pid) +
                                           ") exited in the middle of the shared-memory pipeline");
    }
    const double limit = comm_.timeout_seconds;
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
    if (limit > 0 && waited.count() > limit) {
      segment_.broken = true;
      throw Error(MESHRUN_DEADLINE_EXCEEDED,
                  peer + ") did not arrive within " + seconds_text(limit) +
                      " s (the world's timeout) in the shared-memory pipeline");
    }
  }

  const Comm& comm_;
  Segment& segment_;
};

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

}  // namespace

void all_reduce(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op) {
  Segment& segment = *comm.segment;
  if (segment.broken) {
    throw Error(MESHRUN_FAILED_PRECONDITION,
                "an earlier all_reduce on this communicator failed midway, leaving its ranks out "
                "of step; the communicator cannot be used for large all_reduces any more");
  }
  const Dtype dtype = buffers.dtype;
  const size_t element = element_bytes(dtype);
  const int ranks = comm.size;
  const int me = comm.rank;
  // Each owner's region of a slot, and the part of it this call's pieces use.
  const size_t region_bytes = segment.slot_bytes() / static_cast<size_t>(ranks);
  const size_t share = share_bytes(buffers.count * element, segment.slot_bytes(), ranks) / element;
  const size_t piece = share * static_cast<size_t>(ranks);
  const uint64_t pieces = (buffers.count + piece - 1) / piece;
  const uint64_t first_sequence = segment.next;
  segment.next += pieces;
  Published& mine = segment.of(me);
  Waiter waiter(comm, segment);
  const auto range = [&](uint64_t p, int owner) {
    const size_t begin = std::min(p * piece + static_cast<size_t>(owner) * share, buffers.count);
    return Range{begin, std::min(share, buffers.count - begin)};
  };
  const auto copy_in = [&](uint64_t p) {
    const uint64_t sequence = first_sequence + p;
    if (sequence >= kSlots) {
      for (int q = 0; q < ranks; ++q) waiter.await(q, &Published::done, sequence + 1 - kSlots);
    }
    std::byte* slot = segment.slot(me, sequence);
    for (int q = 0; q < ranks; ++q) {
      const Range part = range(p, q);
      if (q == me || part.count == 0) continue;
      std::memcpy(slot + static_cast<size_t>(q) * region_bytes, buffers.send + part.first * element,
                  part.count * element);
    }
    mine.in.value.store(sequence + 1, std::memory_order_release);
  };
  const bool stream = buffers.count * element >= stream_min_bytes();
  const auto copy_out = [&](std::byte* dst, const std::byte* src, size_t bytes) {
    if (stream) {
      stream_copy(dst, src, bytes);
    } else {
      std::memcpy(dst, src, bytes);
    }
  };
  std::byte* acc = sized(scratch.accumulator, share * accumulator_bytes(dtype));
  copy_in(0);
  for (uint64_t p = 0; p < pieces; ++p) {
    const uint64_t sequence = first_sequence + p;
    const Range own = range(p, me);
    std::byte* result = segment.slot(me, sequence) + static_cast<size_t>(me) * region_bytes;
    for (int step = 1; step < ranks; ++step) {
      waiter.await(peer_at(comm, step), &Published::in, sequence + 1);
    }
    const auto peer_input = [&](int step) -> const void* {
      return segment.slot(peer_at(comm, step), sequence) + static_cast<size_t>(me) * region_bytes;
    };
    reduce(dtype, op, ranks, buffers.send + own.first * element, peer_input, acc,
           {result, buffers.recv + own.first * element, stream}, own.count);
    mine.out.value.store(sequence + 1, std::memory_order_release);
    if (p + 1 < pieces) copy_in(p + 1);
    for (int step = 1; step < ranks; ++step) {
      const int q = peer_at(comm, step);
      const Range theirs = range(p, q);
      waiter.await(q, &Published::out, sequence + 1);
      copy_out(buffers.recv + theirs.first * element,
               segment.slot(q, sequence) + static_cast<size_t>(q) * region_bytes,
               theirs.count * element);
    }
    mine.done.value.store(sequence + 1, std::memory_order_release);
  }
  // The caller may read recv as soon as the engine reports completion.
  if (stream) stream_fence();
}

}  // namespace meshrun::mpi::pipeline
