// The shared segment of a communicator whose ranks are all on this node: one
// POSIX shared-memory object that every rank maps. It holds what each rank
// publishes to the others (sequence counters, its buffers' addresses) and
// the slots through which large all_reduces stream (pipeline.cpp); the
// shared-memory collectives (shared_memory.cpp) meet through it.
//
// Every counter has one writer, its rank, which stores sequence numbers that
// only grow (with release, through publish()); the others wait for it to
// reach a value (with acquire, through Waiter). A waiter spins briefly, then
// yields its core between looks, and after a long wait sleeps on a futex in
// the segment that the writer wakes: a rank waiting for a late peer gives
// its core back, to its own compute thread or to the peer.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "communicator.hpp"
#include "nontemporal.hpp"

namespace meshrun::mpi {

// A counter alone on its cache line: one rank stores, the others poll, and
// no store of another counter disturbs the line. Lock-free atomics are
// address-free, so they work between processes that map them at different
// addresses.
struct alignas(kLineBytes) Counter {
  std::atomic<uint64_t> value{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// What one rank publishes.
struct Published {
  // The pipelined all_reduce (pipeline.cpp): the sequence number + 1 of the
  // last piece whose inputs (`in`) or result (`out`) are in this rank's
  // slot, and of the last piece it has finished reading from every slot
  // (`done`).
  Counter in;
  Counter out;
  Counter done;
  // The shared-memory collectives (shared_memory.cpp): the number of the
  // last one this rank has entered with its buffers' addresses below
  // (`arrive`), and of the last one it is finished with (`leave`).
  Counter arrive;
  Counter leave;
  struct alignas(kLineBytes) Addresses {
    std::atomic<uint64_t> send{0};
    std::atomic<uint64_t> recv{0};
  } addresses;
  // Waiters sleeping on this rank's counters, and the futex word they sleep
  // on, which publish() bumps to wake them.
  struct alignas(kLineBytes) Wakeup {
    std::atomic<uint32_t> sleepers{0};
    std::atomic<uint32_t> word{0};
  } wakeup;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free);

// Slots per rank: a rank may copy in up to kSlots - 1 pieces ahead of the
// slowest peer's copy-out, which absorbs a peer being descheduled briefly.
constexpr uint64_t kSlots = 4;

// Bytes of a mailbox: the largest all_reduce that goes through mailboxes
// (shared_memory.cpp). Each rank has two, used by alternate collectives.
constexpr size_t kMailboxBytes = size_t{16} << 10;

// A mapped segment: every rank's Published, then every rank's two
// mailboxes, then every rank's kSlots slots. Only the engine thread uses it.
class Segment {
 public:
  Segment(void* base, int ranks, size_t slot_bytes, std::vector<int> world_ranks);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  Published& of(int rank) { return reinterpret_cast<Published*>(base_)[rank]; }
  std::byte* slot(int rank, uint64_t sequence) {
    return slots_ + (static_cast<size_t>(rank) * kSlots + sequence % kSlots) * slot_bytes_;
  }
  size_t slot_bytes() const { return slot_bytes_; }
  // `rank`'s mailbox for the collective numbered `number`.
  std::byte* mailbox(int rank, uint64_t number) {
    return mailboxes_ + (static_cast<size_t>(rank) * 2 + number % 2) * kMailboxBytes;
  }
  int world_rank(int rank) const { return world_ranks_[static_cast<size_t>(rank)]; }

  // Stores `value` into `rank`'s `counter` with release and wakes whoever
  // sleeps waiting for it.
  void publish(int rank, Counter Published::*counter, uint64_t value);

  // The sequence number of the next pipelined piece, and the number of the
  // last shared-memory collective; both advance identically on every rank.
  uint64_t next_piece = 0;
  uint64_t last_collective = 0;
  // Set when a call gave up midway: the ranks' counters no longer agree on
  // where the next call starts.
  bool broken = false;

 private:
  std::byte* base_;
  size_t bytes_;
  std::byte* mailboxes_;
  std::byte* slots_;
  size_t slot_bytes_;
  std::vector<int> world_ranks_;
};

// Collective over `comm` (every rank on this node, size > 1), on the engine
// thread: rank 0 creates the object, every rank maps it, and rank 0 unlinks
// its name as soon as all have, so that nothing is left behind when a rank
// dies later. Null on every rank when any rank could not map it.
std::shared_ptr<Segment> make_segment(const Comm& comm);

// Waits for peers' counters, within the communicator's timeout. Throws
// UNAVAILABLE naming the peer when it has exited, DEADLINE_EXCEEDED when it
// has not arrived in time; either marks the segment broken.
class Waiter {
 public:
  Waiter(const Comm& comm, Segment& segment) : comm_(comm), segment_(segment) {}

  // Returns once `rank`'s `counter` reaches `target`.
  void await(int rank, Counter Published::*counter, uint64_t target);

 private:
  void sleep(int rank, const std::atomic<uint64_t>& value, uint64_t target);
  void check(int rank, std::chrono::steady_clock::time_point start);

  const Comm& comm_;
  Segment& segment_;
};

}  // namespace meshrun::mpi
