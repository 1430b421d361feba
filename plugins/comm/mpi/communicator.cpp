#include "communicator.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "collectives.hpp"
#include "engine.hpp"
#include "remote_memory.hpp"
#include "segment.hpp"

namespace meshrun::mpi {
namespace {

// What a rank's probe holds: tells a correct read from stale memory.
uint64_t probe_value(pid_t pid) { return 0x6d657368'72756e00u ^ static_cast<uint64_t>(pid); }

// Every rank reads a known value from every other rank's memory and writes
// its own into theirs: the shared-memory path is used only where
// cross-memory attach works both ways between all of them (a container may
// forbid it). Collective; every rank gets the same answer.
bool peers_reachable(const Comm& comm) {
  const auto ranks = static_cast<size_t>(comm.size);
  const uint64_t probe = probe_value(getpid());
  std::vector<uint64_t> mailbox(ranks, 0);  // slot q: what rank q wrote here
  const uint64_t mine[2] = {reinterpret_cast<uint64_t>(&probe),
                            reinterpret_cast<uint64_t>(mailbox.data())};
  std::vector<uint64_t> addresses(2 * ranks);
  check_mpi(MPI_Allgather(mine, 2, MPI_UINT64_T, addresses.data(), 2, MPI_UINT64_T, comm.comm),
            "MPI_Allgather");
  int reachable = 1;
  for (size_t q = 0; q < ranks; ++q) {
    if (static_cast<int>(q) == comm.rank) continue;
    const pid_t pid = comm.pids[q];
    uint64_t value = 0;
    const uint64_t slot = addresses[2 * q + 1] + static_cast<uint64_t>(comm.rank) * sizeof probe;
    if (!try_read_remote(pid, addresses[2 * q], &value, sizeof value) ||
        value != probe_value(pid) || !try_write_remote(pid, slot, &probe, sizeof probe)) {
      reachable = 0;
    }
  }
  // Every write has landed once all ranks are past this; it also keeps the
  // probes alive until then.
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &reachable, 1, MPI_INT, MPI_MIN, comm.comm),
            "MPI_Allreduce");
  for (size_t q = 0; q < ranks && reachable == 1; ++q) {
    if (static_cast<int>(q) != comm.rank && mailbox[q] != probe_value(comm.pids[q])) reachable = 0;
  }
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &reachable, 1, MPI_INT, MPI_MIN, comm.comm),
            "MPI_Allreduce");
  return reachable == 1;
}

void find_shared_memory(Comm& comm) {
  const pid_t pid = getpid();
  comm.pids.resize(static_cast<size_t>(comm.size));
  static_assert(sizeof(pid_t) == sizeof(int));
  check_mpi(MPI_Allgather(&pid, 1, MPI_INT, comm.pids.data(), 1, MPI_INT, comm.comm),
            "MPI_Allgather");
  comm.shared_memory = peers_reachable(comm);
  if (comm.size > 1) comm.segment = make_segment(comm);
}

std::shared_ptr<Comm> adopt(MPI_Comm handle, std::string name, double timeout_seconds, int node);

// The hierarchy of a communicator whose `nodes` (by rank) are several, with
// the same number of its ranks on each and more than one on some. Node
// index n is the n-th node in order of its lowest rank; local index l the
// l-th rank of the node in rank order. Null otherwise, or with
// MESHRUN_MPI_HIERARCHICAL=0.
std::shared_ptr<const Comm::Hierarchy> make_hierarchy(const Comm& comm,
                                                      const std::vector<int>& nodes) {
  std::map<int, int> index_of_node;  // node -> node index
  std::vector<int> local_index(nodes.size());
  std::vector<int> ranks_on(nodes.size(), 0);  // by node index
  for (size_t r = 0; r < nodes.size(); ++r) {
    const int n =
        index_of_node.try_emplace(nodes[r], static_cast<int>(index_of_node.size())).first->second;
    local_index[r] = ranks_on[static_cast<size_t>(n)]++;
  }
  const auto node_count = static_cast<int>(index_of_node.size());
  const int local_size = ranks_on[0];
  const bool balanced = std::all_of(ranks_on.begin(), ranks_on.begin() + node_count,
                                    [&](int ranks) { return ranks == local_size; });
  if (node_count < 2 || local_size < 2 || !balanced ||
      bytes_from_environment("MESHRUN_MPI_HIERARCHICAL", 1) == 0) {
    return nullptr;
  }
  auto hierarchy = std::make_shared<Comm::Hierarchy>();
  hierarchy->rank_at.resize(nodes.size());
  for (size_t r = 0; r < nodes.size(); ++r) {
    const int n = index_of_node.at(nodes[r]);
    hierarchy->rank_at[static_cast<size_t>(n * local_size + local_index[r])] = static_cast<int>(r);
  }
  const auto me = static_cast<size_t>(comm.rank);
  const int my_node_index = index_of_node.at(nodes[me]);
  MPI_Comm node_handle = MPI_COMM_NULL;
  MPI_Comm across_handle = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(comm.comm, my_node_index, comm.rank, &node_handle), "MPI_Comm_split");
  check_mpi(MPI_Comm_split(comm.comm, local_index[me], my_node_index, &across_handle),
            "MPI_Comm_split");
  hierarchy->node = adopt(node_handle, comm.name + " (this node)", comm.timeout_seconds, comm.node);
  hierarchy->across =
      adopt(across_handle, comm.name + " (across nodes)", comm.timeout_seconds, comm.node);
  return hierarchy;
}

// Takes ownership of `handle` and learns what the collectives need: where
// its ranks are (this rank on `node`), and the paths that follows.
std::shared_ptr<Comm> adopt(MPI_Comm handle, std::string name, double timeout_seconds, int node) {
  auto comm = std::make_shared<Comm>();
  comm->comm = handle;
  comm->name = std::move(name);
  comm->timeout_seconds = timeout_seconds;
  comm->node = node;
  check_mpi(MPI_Comm_set_errhandler(handle, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(handle, &comm->rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(handle, &comm->size), "MPI_Comm_size");
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &comm->world_rank), "MPI_Comm_rank");
  void* tag_ub = nullptr;
  int found = 0;
  check_mpi(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found), "MPI_Comm_get_attr");
  if (found) comm->tag_ub = *static_cast<int*>(tag_ub);
  std::vector<int> nodes(static_cast<size_t>(comm->size));
  check_mpi(MPI_Allgather(&node, 1, MPI_INT, nodes.data(), 1, MPI_INT, handle), "MPI_Allgather");
  if (std::all_of(nodes.begin(), nodes.end(), [&](int n) { return n == node; })) {
    find_shared_memory(*comm);
  } else {
    comm->hierarchy = make_hierarchy(*comm, nodes);
  }
  return comm;
}

// The node of this world rank (see make_world): the lowest world rank that
// shares its node.
int node_of_world_rank() {
  int world_rank = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank");
  const size_t simulated = bytes_from_environment("MESHRUN_RANKS_PER_NODE", 0);
  if (simulated > 0) {
    const auto per_node = static_cast<int>(std::min<size_t>(simulated, INT32_MAX));
    return world_rank / per_node * per_node;
  }
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &node),
      "MPI_Comm_split_type");
  int lowest = world_rank;
  const int rc = MPI_Allreduce(&world_rank, &lowest, 1, MPI_INT, MPI_MIN, node);
  check_mpi(MPI_Comm_free(&node), "MPI_Comm_free");
  check_mpi(rc, "MPI_Allreduce");
  return lowest;
}

}  // namespace

std::shared_ptr<Comm> make_world(double timeout_seconds) {
  MPI_Comm handle = MPI_COMM_NULL;
  const int node = node_of_world_rank();
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &handle), "MPI_Comm_dup");
  return adopt(handle, "world", timeout_seconds, node);
}

std::shared_ptr<Comm> split_comm(const Comm& parent, int color, int key, const std::string& name) {
  MPI_Comm handle = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(parent.comm, color, key, &handle), "MPI_Comm_split");
  return adopt(handle, name, parent.timeout_seconds, parent.node);
}

void free_comm(Comm& comm) {
  comm.segment.reset();
  if (comm.hierarchy) {
    free_comm(*comm.hierarchy->node);
    free_comm(*comm.hierarchy->across);
  }
  if (comm.comm != MPI_COMM_NULL) check_mpi(MPI_Comm_free(&comm.comm), "MPI_Comm_free");
}

std::string describe(const char* op, const Comm& comm) {
  return std::string(op) + " on communicator '" + comm.name + "' (size " +
         std::to_string(comm.size) + ", world rank " + std::to_string(comm.world_rank) + ")";
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", seconds);
  return text;
}

}  // namespace meshrun::mpi
