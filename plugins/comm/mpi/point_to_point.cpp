#include "point_to_point.hpp"

#include <algorithm>

#include "engine.hpp"

namespace meshrun::mpi {
namespace {

constexpr size_t kPieceBytes = size_t{1} << 30;

}  // namespace

// An empty transfer is one empty message, which still matches the peer's.
std::vector<MPI_Request> start_transfer(const Comm& comm, Direction direction, std::byte* data,
                                        size_t bytes, int peer, int tag) {
  std::vector<MPI_Request> requests;
  size_t done = 0;
  do {
    const size_t length = std::min(kPieceBytes, bytes - done);
    const int count = static_cast<int>(length);
    MPI_Request request = MPI_REQUEST_NULL;
    if (direction == Direction::send) {
      check_mpi(MPI_Isend(data + done, count, MPI_BYTE, peer, tag, comm.comm, &request),
                "MPI_Isend");
    } else {
      check_mpi(MPI_Irecv(data + done, count, MPI_BYTE, peer, tag, comm.comm, &request),
                "MPI_Irecv");
    }
    requests.push_back(request);
    done += length;
  } while (done < bytes);
  return requests;
}

}  // namespace meshrun::mpi
