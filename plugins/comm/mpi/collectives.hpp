// The collectives, run on the engine thread. Each picks one of these paths,
// the same on every rank since the choice depends only on the communicator
// and the sizes every rank shares:
//   - hierarchical (all_reduce, all_gather, reduce_scatter): ranks on
//     several nodes, the same number on each, more than one on some, and at
//     least MESHRUN_MPI_HIERARCHICAL_MIN_BYTES (default 0) in the operation:
//     the part inside each node takes the paths below, the part across nodes
//     MPI, on 1/L of the data (hierarchical.cpp);
//   - pipeline (all_reduce only): every rank on this node, and at least
//     MESHRUN_MPI_SHM_MIN_BYTES and MESHRUN_MPI_PIPELINE_MIN_BYTES (default
//     4 MiB) in the operation: ranks stream their buffers through a POSIX
//     shared-memory segment in cache-sized pieces of at most
//     MESHRUN_MPI_PIPELINE_SLOT_BYTES (default 2 MiB, less where /dev/shm
//     is small; rank 0's value holds) (pipeline.cpp), writing results into
//     recv with non-temporal stores from MESHRUN_MPI_STREAM_MIN_BYTES
//     (default 4 MiB);
//   - mailboxes (all_reduce only): every rank on this node, and at most
//     MESHRUN_MPI_MAILBOX_MAX_BYTES (default and largest 16 KiB) in the
//     operation: each rank copies its send into the segment and reduces
//     everyone's (shared_memory.cpp);
//   - shared memory: every rank on this node, cross-memory attach working
//     between them and the segment mapped (segment.hpp), and at least
//     MESHRUN_MPI_SHM_MIN_BYTES (default 16 KiB) in the operation: ranks
//     meet in the segment and read and write each other's buffers directly;
//   - MPI: everything else, in pieces of at most MESHRUN_MPI_PIECE_BYTES
//     (default 4 MiB) so that no message is large enough to hit Open MPI's
//     slow large-message algorithms, and 16-bit reductions need only a
//     piece-sized float32 buffer.
// All but MESHRUN_MPI_STREAM_MIN_BYTES must be the same on every rank.
#pragma once

#include <cstddef>
#include <vector>

#include "communicator.hpp"
#include "dtype.hpp"
#include "engine.hpp"

namespace meshrun::mpi {

// The memory of one collective. `count` is the number of elements of: send
// and recv (all_reduce), send (all_gather: recv holds size * count), recv
// (reduce_scatter: send holds size * count), the tensor (broadcast, whose
// send and recv are both the tensor).
struct Buffers {
  const std::byte* send;
  std::byte* recv;
  size_t count;
  Dtype dtype;
};

void all_reduce(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op);
void all_gather(const Comm& comm, Scratch& scratch, const Buffers& buffers);
void reduce_scatter(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op);
void broadcast(const Comm& comm, const Buffers& buffers, int root);
void barrier(const Comm& comm);

// An all-to-all's memory: the bytes this rank sends to and receives from
// each rank, the blocks packed in rank order.
struct AllToAllBuffers {
  const std::byte* send;
  std::byte* recv;
  std::vector<int> send_bytes, recv_bytes;
};
// Over MPI_Alltoallv (every path: its traffic has no reduction to fuse).
void all_to_all(const Comm& comm, const AllToAllBuffers& buffers);

// The environment variable `name` as a decimal number of bytes; `fallback`
// when it is unset or not a number.
size_t bytes_from_environment(const char* name, size_t fallback);

// True when [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes);

// The peer `step` places after this rank: the shared-memory paths visit
// peers in rotation so that they are not all read from at once.
int peer_at(const Comm& comm, int step);

// The paths. Called with count > 0.
namespace shared_memory {
void all_reduce_small(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op);
void all_reduce(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op);
void all_gather(const Comm& comm, Scratch& scratch, const Buffers& buffers);
void reduce_scatter(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op);
void broadcast(const Comm& comm, const Buffers& buffers, int root);
}  // namespace shared_memory

namespace pipeline {
void all_reduce(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op);
}  // namespace pipeline

namespace hierarchical {
void all_reduce(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op);
void all_gather(const Comm& comm, Scratch& scratch, const Buffers& buffers);
void reduce_scatter(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op);
}  // namespace hierarchical

namespace via_mpi {
// Largest message the MPI path sends at once.
size_t piece_bytes();
void all_reduce(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op);
void all_gather(const Comm& comm, Scratch& scratch, const Buffers& buffers);
void reduce_scatter(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op);
void broadcast(const Comm& comm, const Buffers& buffers, int root);
}  // namespace via_mpi

}  // namespace meshrun::mpi
