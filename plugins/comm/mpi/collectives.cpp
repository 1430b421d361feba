#include "collectives.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "segment.hpp"

namespace meshrun::mpi {
namespace {

// Measured on 2 ranks of one node: the shared-memory path is as fast as
// Open MPI's at 4 KiB and twice as fast from 16 KiB up.
constexpr size_t kDefaultSharedMemoryMinBytes = size_t{16} << 10;

size_t shared_memory_min_bytes() {
  static const size_t bytes =
      bytes_from_environment("MESHRUN_MPI_SHM_MIN_BYTES", kDefaultSharedMemoryMinBytes);
  return bytes;
}

bool use_shared_memory(const Comm& comm, size_t bytes) {
  return comm.shared_memory && comm.segment != nullptr && bytes >= shared_memory_min_bytes();
}

// Cross-memory attach reaches ~10 GB/s at 1 MiB on 2 ranks but its kernel
// copies cap it at ~6.5 GB/s beyond (3.6-3.9 GB/s busbw at 64-256 MiB),
// where the pipeline's cache-resident slots do better; below a few MiB the
// pipeline's per-piece handshakes cost more than they save.
constexpr size_t kDefaultPipelineMinBytes = size_t{4} << 20;

bool use_pipeline(const Comm& comm, size_t bytes) {
  static const size_t min_bytes =
      bytes_from_environment("MESHRUN_MPI_PIPELINE_MIN_BYTES", kDefaultPipelineMinBytes);
  return comm.segment != nullptr && bytes >= shared_memory_min_bytes() && bytes >= min_bytes;
}

// Below a few KiB an all_reduce is all latency: one meeting in the segment
// beats MPI_Allreduce's rounds through Open MPI's shared-memory transport,
// and its waits sleep rather than spin.
bool use_mailboxes(const Comm& comm, size_t bytes) {
  static const size_t max_bytes = std::min(
      bytes_from_environment("MESHRUN_MPI_MAILBOX_MAX_BYTES", kMailboxBytes), kMailboxBytes);
  return comm.segment != nullptr && bytes <= max_bytes;
}

// Measured on 2 simulated nodes x 2 ranks over TCP: see docs/design.md.
bool use_hierarchy(const Comm& comm, size_t bytes) {
  static const size_t min_bytes = bytes_from_environment("MESHRUN_MPI_HIERARCHICAL_MIN_BYTES", 0);
  return comm.hierarchy != nullptr && bytes >= min_bytes;
}

}  // namespace

size_t bytes_from_environment(const char* name, size_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text < '0' || *text > '9') return fallback;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  return *end == '\0' ? static_cast<size_t>(value) : fallback;
}

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto a_begin = reinterpret_cast<uintptr_t>(a);
  const auto b_begin = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && a_begin < b_begin + b_bytes && b_begin < a_begin + a_bytes;
}

int peer_at(const Comm& comm, int step) { return (comm.rank + step) % comm.size; }

void all_reduce(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op) {
  if (buffers.count == 0) return;
  const size_t bytes = buffers.count * element_bytes(buffers.dtype);
  if (use_hierarchy(comm, bytes)) {
    hierarchical::all_reduce(comm, scratch, buffers, op);
  } else if (use_pipeline(comm, bytes)) {
    pipeline::all_reduce(comm, scratch, buffers, op);
  } else if (use_mailboxes(comm, bytes)) {
    shared_memory::all_reduce_small(comm, scratch, buffers, op);
  } else if (use_shared_memory(comm, bytes)) {
    shared_memory::all_reduce(comm, scratch, buffers, op);
  } else {
    via_mpi::all_reduce(comm, scratch, buffers, op);
  }
}

void all_gather(const Comm& comm, Scratch& scratch, const Buffers& buffers) {
  if (buffers.count == 0) return;
  const size_t total =
      buffers.count * element_bytes(buffers.dtype) * static_cast<size_t>(comm.size);
  if (use_hierarchy(comm, total)) {
    hierarchical::all_gather(comm, scratch, buffers);
  } else if (use_shared_memory(comm, total)) {
    shared_memory::all_gather(comm, scratch, buffers);
  } else {
    via_mpi::all_gather(comm, scratch, buffers);
  }
}

void reduce_scatter(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op) {
  if (buffers.count == 0) return;
  const size_t total =
      buffers.count * element_bytes(buffers.dtype) * static_cast<size_t>(comm.size);
  if (use_hierarchy(comm, total)) {
    hierarchical::reduce_scatter(comm, scratch, buffers, op);
  } else if (use_shared_memory(comm, total)) {
    shared_memory::reduce_scatter(comm, scratch, buffers, op);
  } else {
    via_mpi::reduce_scatter(comm, scratch, buffers, op);
  }
}

void broadcast(const Comm& comm, const Buffers& buffers, int root) {
  if (buffers.count == 0) return;
  if (use_shared_memory(comm, buffers.count * element_bytes(buffers.dtype))) {
    shared_memory::broadcast(comm, buffers, root);
  } else {
    via_mpi::broadcast(comm, buffers, root);
  }
}

void barrier(const Comm& comm) { check_mpi(MPI_Barrier(comm.comm), "MPI_Barrier"); }

void all_to_all(const Comm& comm, const AllToAllBuffers& buffers) {
  const auto ranks = static_cast<size_t>(comm.size);
  std::vector<int> send_at(ranks, 0), recv_at(ranks, 0);
  for (size_t r = 1; r < ranks; ++r) {
    send_at[r] = send_at[r - 1] + buffers.send_bytes[r - 1];
    recv_at[r] = recv_at[r - 1] + buffers.recv_bytes[r - 1];
  }
  check_mpi(
      MPI_Alltoallv(buffers.send, buffers.send_bytes.data(), send_at.data(), MPI_BYTE, buffers.recv,
                    buffers.recv_bytes.data(), recv_at.data(), MPI_BYTE, comm.comm),
      "MPI_Alltoallv");
}

}  // namespace meshrun::mpi
