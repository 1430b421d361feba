#include "runtime/job.hpp"

#include "errors.hpp"
#include "launch/launch.hpp"

namespace meshrun {

Job::Job(const Config& config, const PluginLoader& loader)
    : backend_(loader, config.comm.backend),
      timeout_seconds_(config.comm.timeout_minutes * 60.0),
      world_(backend_.world(timeout_seconds_)) {
  const auto environment = launch::detect_launcher();
  if (environment && environment->local_rank) local_rank_ = *environment->local_rank;
}

void Job::split_axes(const MeshContext& mesh) {
  axes_ = std::make_unique<MeshCommunicators>(world_, mesh);
}

Communicator& Job::communicator(const std::string& axis) {
  if (axis == "world") return world_;
  if (!axes_) {
    throw Error(MESHRUN_FAILED_PRECONDITION, "the mesh communicators are not made yet");
  }
  return axes_->axis(require_axis(axis));
}

}  // namespace meshrun
