#include "communicator.hpp"

#include <unistd.h>

#include <cstdint>

#include "engine.hpp"
#include "remote_memory.hpp"
#include "segment.hpp"

namespace meshrun::mpi {
namespace {

// What a rank's probe holds: tells a correct read from stale memory.
uint64_t probe_value(pid_t pid) { return 0x6d657368'72756e00u ^ static_cast<uint64_t>(pid); }

// True when every rank of `comm` shares this node, judged by MPI.
bool all_on_this_node(const Comm& comm) {
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm.comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  int node_size = 0;
  check_mpi(MPI_Comm_size(node, &node_size), "MPI_Comm_size");
  check_mpi(MPI_Comm_free(&node), "MPI_Comm_free");
  return node_size == comm.size;
}

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
  if (!all_on_this_node(comm)) return;
  const pid_t pid = getpid();
  comm.pids.resize(static_cast<size_t>(comm.size));
  static_assert(sizeof(pid_t) == sizeof(int));
  check_mpi(MPI_Allgather(&pid, 1, MPI_INT, comm.pids.data(), 1, MPI_INT, comm.comm),
            "MPI_Allgather");
  comm.shared_memory = peers_reachable(comm);
  if (comm.size > 1) comm.segment = make_segment(comm);
}

// Takes ownership of `handle` and learns what the collectives need.
std::shared_ptr<Comm> adopt(MPI_Comm handle, std::string name, double timeout_seconds) {
  auto comm = std::make_shared<Comm>();
  comm->comm = handle;
  comm->name = std::move(name);
  comm->timeout_seconds = timeout_seconds;
  check_mpi(MPI_Comm_set_errhandler(handle, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(handle, &comm->rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(handle, &comm->size), "MPI_Comm_size");
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &comm->world_rank), "MPI_Comm_rank");
  void* tag_ub = nullptr;
  int found = 0;
  check_mpi(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found), "MPI_Comm_get_attr");
  if (found) comm->tag_ub = *static_cast<int*>(tag_ub);
  find_shared_memory(*comm);
  return comm;
}

}  // namespace

std::shared_ptr<Comm> make_world(double timeout_seconds) {
  MPI_Comm handle = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &handle), "MPI_Comm_dup");
  return adopt(handle, "world", timeout_seconds);
}

std::shared_ptr<Comm> split_comm(const Comm& parent, int color, int key, const std::string& name) {
  MPI_Comm handle = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(parent.comm, color, key, &handle), "MPI_Comm_split");
  return adopt(handle, name, parent.timeout_seconds);
}

void free_comm(Comm& comm) {
  comm.segment.reset();
  if (comm.comm != MPI_COMM_NULL) check_mpi(MPI_Comm_free(&comm.comm), "MPI_Comm_free");
}

std::string describe(const char* op, const Comm& comm) {
  return std::string(op) + " on communicator '" + comm.name + "' (size " +
         std::to_string(comm.size) + ", world rank " + std::to_string(comm.world_rank) + ")";
}

}  // namespace meshrun::mpi
