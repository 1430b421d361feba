// A process's part in a running job, as the host API joins it: the comm
// backend, the world communicator and one communicator per mesh axis, and
// for a CUDA run (dist_env.backend = "nccl") also MPI's world, over host
// memory, which NCCL's starts from.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "mesh/mesh.hpp"
#include "plugin/loader.hpp"

namespace meshrun {

class Job {
 public:
  // Loads config.comm.backend and makes the world communicator (with the
  // config's comm timeout); collective over the job. A CUDA run first joins
  // the "mpi" backend's world, then starts config.comm.backend's on the
  // rank's GPU (launched_rank_gpu) from it: throws UNAVAILABLE naming the
  // rank when the process sees no GPU.
  Job(const Config& config, const PluginLoader& loader);
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // The world of config.comm.backend: the one the mesh axes split from,
  // over the run's device memory.
  Communicator& world() { return *world_; }
  // The world over host memory (the trainer's sums, checkpoints, traces):
  // MPI's on a CUDA run, else world().
  Communicator& host_world() { return host_world_ ? *host_world_ : *world_; }
  // The rank among the ranks of this node, when the launcher says; else 0.
  int64_t local_rank() const { return local_rank_; }
  double timeout_seconds() const { return timeout_seconds_; }

  // Splits one communicator per axis of `mesh`; collective over the job.
  void split_axes(const MeshContext& mesh);
  // "world" or a mesh axis; throws NOT_FOUND for an unknown axis or one the
  // mesh has not, FAILED_PRECONDITION before split_axes.
  Communicator& communicator(const std::string& axis);

 private:
  double timeout_seconds_;
  std::optional<CommBackend> host_backend_;
  std::optional<Communicator> host_world_;
  std::optional<CommBackend> backend_;
  std::optional<Communicator> world_;
  int64_t local_rank_ = 0;
  std::unique_ptr<MeshCommunicators> axes_;
};

}  // namespace meshrun
