#include "segment.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <new>
#include <string>

#include "collectives.hpp"
#include "meshrun/plugin.hpp"

namespace meshrun::mpi {
namespace {

using meshrun::plugin::Error;

// Bytes of one slot, split among the ranks: the largest pipelined piece. On
// 2 ranks here 2 MiB pieces ran 64 and 256 MiB all_reduces 8-10% faster than
// 256 KiB ones: fewer hand-overs, and a peer's result has mostly left the
// writer's L2 for the shared L3 by the time it is read, which is cheaper
// than a snoop. The slots of every rank (16 MiB on 2 ranks) still sit in the
// L3.
constexpr size_t kDefaultSlotBytes = size_t{2} << 20;
// A segment takes at most this fraction of the free space of the file
// system behind shm_open (/dev/shm): its pages are allocated as they are
// first touched, and a touch beyond a full tmpfs kills the process with
// SIGBUS, so small /dev/shm mounts (64 MiB in a default container) get
// smaller slots instead.
constexpr size_t kShmShareDivisor = 16;
// A waiting rank first spins (a peer a few microseconds behind is caught
// without a system call), then yields its core between looks (a peer that
// shares the core, or the rank's own compute thread, runs meanwhile), and
// sleeps on the futex only once a wait is long: a rank waiting for another
// that writes a checkpoint, say. Sleeping from the first miss added 30-40%
// to 1-16 MiB all_reduces (a wake-up costs tens of microseconds here), and
// sleeping after 500 µs made DDP's gradient all_reduce, which waits for a
// peer still in its backward, 1-2% slower per step than yielding.
constexpr auto kSpinFor = std::chrono::microseconds(20);
constexpr auto kYieldFor = std::chrono::milliseconds(5);
// A sleeping waiter wakes this often to see whether the peer still lives
// and whether the timeout has passed.
constexpr long kSleepNanoseconds = 20'000'000;

// What rank 0 tells the others about the segment.
struct Announcement {
  char name[64];  // empty: rank 0 could not make it
  uint64_t slot_bytes;
};

size_t header_bytes(int ranks) {
  return (sizeof(Published) * static_cast<size_t>(ranks) + 4095) & ~size_t{4095};
}

size_t mapped_bytes(int ranks, size_t slot_bytes) {
  return header_bytes(ranks) +
         static_cast<size_t>(ranks) * (2 * kMailboxBytes + kSlots * slot_bytes);
}

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

void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The futex word is shared between processes, so neither call is
// FUTEX_PRIVATE_FLAG. FUTEX_WAIT returns at once unless `word` still holds
// `expected`, which closes the race with a wake between the waiter's check
// and its sleep.
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, long nanoseconds) {
  const timespec timeout{0, nanoseconds};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, &timeout, nullptr,
          0);
}

void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

Segment::Segment(void* base, int ranks, size_t slot_bytes, std::vector<int> world_ranks)
    : base_(static_cast<std::byte*>(base)),
      bytes_(mapped_bytes(ranks, slot_bytes)),
      mailboxes_(base_ + header_bytes(ranks)),
      slots_(base_ + bytes_ - static_cast<size_t>(ranks) * kSlots * slot_bytes),
      slot_bytes_(slot_bytes),
      world_ranks_(std::move(world_ranks)) {}

Segment::~Segment() { munmap(base_, bytes_); }

// The fence orders the counter's store before the load of `sleepers`, and a
// sleeper's increment of `sleepers` comes before its load of the counter:
// whichever runs second sees the other, so a waiter never sleeps through the
// value it waits for (and a sleep is also cut short by its timeout).
void Segment::publish(int rank, Counter Published::*counter, uint64_t value) {
  Published& published = of(rank);
  (published.*counter).value.store(value, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (published.wakeup.sleepers.load(std::memory_order_relaxed) == 0) return;
  published.wakeup.word.fetch_add(1, std::memory_order_release);
  futex_wake_all(published.wakeup.word);
}

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

void Waiter::await(int rank, Counter Published::*counter, uint64_t target) {
  const std::atomic<uint64_t>& value = (segment_.of(rank).*counter).value;
  if (value.load(std::memory_order_acquire) >= target) return;
  const auto start = std::chrono::steady_clock::now();
  while (value.load(std::memory_order_acquire) < target) {
    const auto waited = std::chrono::steady_clock::now() - start;
    if (waited < kSpinFor) {
      relax();
    } else if (waited < kYieldFor) {
      sched_yield();
    } else {
      sleep(rank, value, target);
      check(rank, start);
    }
  }
}

// Sleeps until `rank` publishes anything, or for kSleepNanoseconds.
void Waiter::sleep(int rank, const std::atomic<uint64_t>& value, uint64_t target) {
  Published::Wakeup& wakeup = segment_.of(rank).wakeup;
  const uint32_t word = wakeup.word.load(std::memory_order_acquire);
  wakeup.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (value.load(std::memory_order_seq_cst) < target) {
    futex_wait(wakeup.word, word, kSleepNanoseconds);
  }
  wakeup.sleepers.fetch_sub(1, std::memory_order_relaxed);
}

void Waiter::check(int rank, std::chrono::steady_clock::time_point start) {
  const pid_t pid = comm_.pids[static_cast<size_t>(rank)];
  const auto peer = [&] {
    return "rank " + std::to_string(rank) + " (world rank " +
           std::to_string(segment_.world_rank(rank));
  };
  if (kill(pid, 0) != 0 && errno == ESRCH) {
    segment_.broken = true;
    throw Error(MESHRUN_UNAVAILABLE, peer() + ", pid " + std::to_string(pid) +
                                         ") exited in the middle of a shared-memory collective");
  }
  const double limit = comm_.timeout_seconds;
  const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
  if (limit > 0 && waited.count() > limit) {
    segment_.broken = true;
    throw Error(MESHRUN_DEADLINE_EXCEEDED,
                peer() + ") did not arrive within " + seconds_text(limit) +
                    " s (the world's timeout) in a shared-memory collective");
  }
}

}  // namespace meshrun::mpi
