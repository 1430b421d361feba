// A communicator as the engine sees it: the MPI communicator and what the
// collectives need to know about its ranks. Made and freed on the engine
// thread; read-only everywhere once made.
#pragma once

#include <mpi.h>
#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

namespace meshrun::mpi {

class Segment;

struct Comm {
  MPI_Comm comm = MPI_COMM_NULL;
  std::string name;
  int rank = 0;
  int size = 1;
  int world_rank = 0;
  int tag_ub = 32767;            // the largest tag MPI accepts
  double timeout_seconds = 0.0;  // the world's default wait limit; <= 0: none
  // Every rank is on this node and may read and write the others' memory
  // (process_vm_readv / _writev): the collectives' shared-memory path.
  bool shared_memory = false;
  std::vector<pid_t> pids;  // by rank, when every rank is on this node
  // The POSIX shared memory through which the ranks meet (segment.hpp),
  // when every rank is on this node; null otherwise. Only the engine thread
  // uses it.
  std::shared_ptr<Segment> segment;
};

// These run on the engine thread and are collective over the parent.
// A duplicate of MPI_COMM_WORLD named "world".
std::shared_ptr<Comm> make_world(double timeout_seconds);
std::shared_ptr<Comm> split_comm(const Comm& parent, int color, int key, const std::string& name);
void free_comm(Comm& comm);

// "<op> on communicator '<name>' (size S, world rank R)": how messages name
// an operation.
std::string describe(const char* op, const Comm& comm);

}  // namespace meshrun::mpi
