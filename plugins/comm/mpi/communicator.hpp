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
  // This rank's node: the same number on every rank of a node, in every
  // communicator (node_of_world_rank).
  int node = 0;
  // Ranks on several nodes, the same number on each, more than one on some:
  // the hierarchical collectives (hierarchical.cpp) run over these two;
  // otherwise both are null.
  struct Hierarchy {
    std::shared_ptr<Comm> node;  // this rank's node, ranks in this communicator's order
    std::shared_ptr<Comm>
        across;  // one rank per node, this one's place on its node; nodes in order
    // Rank of this communicator of the member with node index n (the
    // across rank) and local index l (the node rank): rank_at[n * L + l].
    std::vector<int> rank_at;
  };
  std::shared_ptr<const Hierarchy> hierarchy;
};

// These run on the engine thread and are collective over the parent.
// A duplicate of MPI_COMM_WORLD named "world". Its ranks' nodes are the
// nodes MPI says share memory, or with MESHRUN_RANKS_PER_NODE=L (the same
// on every rank) nodes of L consecutive world ranks each: nodes simulated on
// one machine, whose ranks then reach each other through MPI only.
std::shared_ptr<Comm> make_world(double timeout_seconds);
std::shared_ptr<Comm> split_comm(const Comm& parent, int color, int key, const std::string& name);
void free_comm(Comm& comm);

// "<op> on communicator '<name>' (size S, world rank R)": how messages name
// an operation.
std::string describe(const char* op, const Comm& comm);

// A wait limit as timeout messages write it ("%g" seconds: "0.5", "1800").
std::string seconds_text(double seconds);

}  // namespace meshrun::mpi
