// A rank's two worlds of the same ranks in the same order, and where its
// training state lives (train_in_worlds, run.hpp). The host's world carries
// the trainer's own collectives on host memory (the scalars it sums,
// checkpoints, the export, the starting weights' tp pieces); the state's
// world those on the state's memory (the strategies' buffers, the tensors
// the model computes on, a pipeline's activations). On the CPU both are the
// launcher's world; on a GPU the state's is a world of the comm backend
// (nccl) started from it.
#pragma once

#include <optional>

#include "comm/comm.hpp"
#include "mesh/mesh.hpp"
#include "model/model.hpp"
#include "state/state_device.hpp"
#include "train/rank_gpu.hpp"

namespace meshrun::train {

// The state device (parameters, gradients, moments, the tensors handed to
// the model), the stream the strategies' collectives run on (NULL on the
// host), and the GPU (null on the host; mem.device_used_peak).
struct RankDevice {
  StateDevice& state;
  void* comm_stream = nullptr;
  RankGpu* gpu = nullptr;
};

// Both worlds and their mesh axes.
struct RankComms {
  Communicator& host_world;
  MeshCommunicators& host;
  Communicator& state_world;
  MeshCommunicators& state;

  bool separate() const { return &host_world != &state_world; }
};

// The groups one strategy instance shards and replicates over.
struct StrategyGroups {
  Communicator& data_parallel;
  Communicator& shard;
  Communicator& replicate;
};

// The dense parameters' groups: dp, dp_shard_cp and dp_replicate.
inline StrategyGroups dense_groups(MeshCommunicators& axes) {
  return {axes.axis(Axis::dp), axes.axis(Axis::dp_shard_cp), axes.axis(Axis::dp_replicate)};
}

// The axes the model computes over: tp, cp, and ep on an MoE mesh.
inline StageCommunicators computing_axes(MeshCommunicators& axes, const MeshContext& mesh) {
  return {&axes.axis(Axis::tp), &axes.axis(Axis::cp),
          mesh.has_moe() ? &axes.axis(Axis::ep) : nullptr};
}

// The groups of the experts' own strategy under expert parallelism, in
// both worlds: ep_shard, without replicas (each rank replicates alone).
// Making it is collective over both worlds; it must outlive the strategy.
class ExpertGroups {
 public:
  ExpertGroups(const RankComms& comms, void* comm_stream)
      : comms_(comms), alone_host_(comms.host_world.split(comms.host_world.rank(), 0, "self")) {
    if (!comms.separate()) return;
    alone_state_.emplace(comms.state_world.split(comms.state_world.rank(), 0, "self"));
    if (comm_stream != nullptr) alone_state_->set_stream(comm_stream);
  }
  // The strategy's groups, and their host twins (the shard's ranges, the norm).
  StrategyGroups state() {
    Communicator& ep_shard = comms_.state.axis(Axis::ep_shard);
    return {ep_shard, ep_shard, alone_state_ ? *alone_state_ : alone_host_};
  }
  StrategyGroups host() {
    Communicator& ep_shard = comms_.host.axis(Axis::ep_shard);
    return {ep_shard, ep_shard, alone_host_};
  }

 private:
  RankComms comms_;
  Communicator alone_host_;
  std::optional<Communicator> alone_state_;
};

}  // namespace meshrun::train
