// A process's part in a running job, as the host API joins it: the comm
// backend, the world communicator and one communicator per mesh axis.
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
  // config's comm timeout); collective over the job.
  Job(const Config& config, const PluginLoader& loader);
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  Communicator& world() { return world_; }
  // The rank among the ranks of this node, when the launcher says; else 0.
  int64_t local_rank() const { return local_rank_; }
  double timeout_seconds() const { return timeout_seconds_; }

  // Splits one communicator per axis of `mesh`; collective over the job.
  void split_axes(const MeshContext& mesh);
  // "world" or a mesh axis; throws NOT_FOUND for an unknown axis or one the
  // mesh has not, FAILED_PRECONDITION before split_axes.
  Communicator& communicator(const std::string& axis);

 private:
  CommBackend backend_;
  double timeout_seconds_;
  Communicator world_;
  int64_t local_rank_ = 0;
  std::unique_ptr<MeshCommunicators> axes_;
};

}  // namespace meshrun
