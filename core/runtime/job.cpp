#include "runtime/job.hpp"

#include "comm/bootstrap.hpp"
#include "errors.hpp"
#include "launch/launch.hpp"
#include "mesh/device.hpp"

namespace meshrun {

Job::Job(const Config& config, const PluginLoader& loader)
    : timeout_seconds_(config.comm.timeout_minutes * 60.0) {
  const auto environment = launch::detect_launcher();
  if (environment && environment->local_rank) local_rank_ = *environment->local_rank;
  if (!config.dist_env.on_cuda()) {
    backend_.emplace(loader, config.comm.backend);
    world_.emplace(backend_->world(timeout_seconds_));
    return;
  }
  host_backend_.emplace(loader, "mpi");
  host_world_.emplace(host_backend_->world(timeout_seconds_));
  const int32_t device = launched_rank_gpu(host_world_->rank());
  backend_.emplace(loader, config.comm.backend);
  const CommBootstrap bootstrap(*host_world_);
  world_.emplace(backend_->world(timeout_seconds_, device, bootstrap.get()));
}

void Job::split_axes(const MeshContext& mesh) {
  axes_ = std::make_unique<MeshCommunicators>(*world_, mesh);
}

Communicator& Job::communicator(const std::string& axis) {
  if (axis == "world") return *world_;
  if (!axes_) {
    throw Error(MESHRUN_FAILED_PRECONDITION, "the mesh communicators are not made yet");
  }
  return axes_->axis(require_axis(axis));
}

}  // namespace meshrun
