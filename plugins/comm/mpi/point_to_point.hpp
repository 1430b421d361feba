// Point-to-point transfers: started with MPI_Isend / MPI_Irecv on the engine
// thread and left to the engine to poll, so that two ranks that both send
// and then receive never wait on each other.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <vector>

#include "communicator.hpp"

namespace meshrun::mpi {

enum class Direction { send, recv };

// Starts sending `bytes` at `data` to `peer`, or receiving them from it, and
// returns the requests of the transfer, which goes in pieces of at most 1 GiB
// (an MPI count is an int): the two sides must agree on `bytes`.
std::vector<MPI_Request> start_transfer(const Comm& comm, Direction direction, std::byte* data,
                                        size_t bytes, int peer, int tag);

}  // namespace meshrun::mpi
