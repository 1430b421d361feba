// The training loop of one rank: micro-batches with gradient accumulation
// through the strategy's hooks, gradient clipping, AdamW, validation,
// metrics, and checkpoints. Under a sharded strategy the optimizer, clipping
// and checkpoints work on the rank's shard (LocalParameters).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "model/model.hpp"
#include "state/checkpoint.hpp"
#include "state/local_parameters.hpp"
#include "state/optimizer.hpp"
#include "strategy/strategy.hpp"
#include "train/data.hpp"
#include "train/hooks.hpp"
#include "train/loop.hpp"
#include "train/metrics.hpp"
#include "train/rank_gpu.hpp"

namespace meshrun::train {

// Parameters with a strategy of their own: the model's (its dense ones in
// a mixture of experts) over the data-parallel axis, the rank's experts
// over ep_shard. Everything outlives the Trainer.
struct TrainPart {
  Strategy& strategy;
  FlatParameters& parameters;  // the replicated storage (released under a sharded strategy)
  const StageUnits& units;     // for a sharded strategy's hooks
  Communicator& shard_group;
  Communicator& replicate_group;
  // Where the squared gradient norms of the part's shards are summed
  // besides the shard group (the ep ranks, which hold different experts),
  // or null.
  Communicator* norm_across = nullptr;
  // The factor the strategy's averaged gradients take: 1 / ep for the
  // experts, whose gradients sum their ep group's ranks' tokens.
  float gradient_scale = 1.0f;
  // Whether this rank writes the part's weights into the export.
  bool exports = true;
};

// What a rank trains with; everything outlives the Trainer.
struct TrainContext {
  const Config& config;
  const TokenData& data;
  const Model& model;
  const std::vector<std::string>& modules;  // all of the model's
  std::vector<TrainPart> parts;             // the dense part first
  // Where the parts' parameters and gradients are (their FlatParameters'
  // device), the optimizer's moments and the data handed to the stage.
  StateDevice& state;
  // The trainer's own collectives, on host memory (the loss, the norm's
  // shares, validation sums, checkpoints, the export): the world, dp and
  // tp. On a GPU the communicators of the state's memory are others.
  Communicator& world;
  Communicator& data_parallel;
  Communicator& tensor_parallel_host;
  StageCommunicators computing;  // the axes the model computes over, on the state's memory
  const TensorParallelLayout& tensor_parallel;
  std::string plan_json;     // the model plan
  std::string options_json;  // the strategy options
  std::string output_dir;
  GemmPeakMeter gemm_peak;
  // The rank's GPU when the state is on one (mem.device_used_peak), else null.
  RankGpu* gpu = nullptr;
};

class Trainer : public TrainingRank {
 public:
  explicit Trainer(TrainContext context);

  // Continues from a sharded checkpoint: parameters, AdamW moments and the
  // step. Sampling depends only on (seed, step), so that is all the state.
  void resume(const CheckpointIndex& index);
  // Trains up to train.steps; rank 0 writes metrics.jsonl and, at the end,
  // the consolidated checkpoint.
  void run(const StepObserver& observer = {});
  void broadcast_parameters();

  // TrainingRank: sets metrics.loss, grad_sync_wait_s and comm_wait_s.
  void train_step(int64_t step, StepMetrics& metrics) override;
  double gradient_norm() override;
  void optimizer_step(const StepMetrics& metrics) override;
  std::optional<int64_t> first_nonfinite_gradient() override;
  std::optional<double> validate() override;
  MemoryUse memory_use() override;
  void save_checkpoint(int64_t step) override;
  void export_weights() override;

 private:
  // A part's shard and its optimizer.
  struct Part {
    Part(const TrainPart& spec, LocalParameters local, const Trainer& trainer);
    TrainPart spec;
    LocalParameters local;
    // local's ranges in the full model's flat layout: all it holds, and
    // what it saves.
    std::vector<HeldRange> held, saved;
    AdamW optimizer;
  };

  double all_reduce(double value, ReduceOp op, Communicator& over);
  double evaluate(int64_t count);
  bool sharded() const { return ctx_.parts.front().strategy.sharded(); }
  std::vector<ShardState> shard_states();
  // The parts' ranges in the full model's layout, one after another as
  // their concatenated state lies.
  std::vector<HeldRange> checkpoint_ranges(bool saved) const;
  TensorParallelRank tensor_parallel() const {
    return {ctx_.tensor_parallel, ctx_.tensor_parallel_host};
  }

  TrainContext ctx_;
  StateDevice& state_;  // ctx_.state
  std::unique_ptr<TimedHooks> hooks_;
  ModelStage stage_;
  std::vector<std::unique_ptr<Part>> parts_;
  ActivationMeter activations_;
  int64_t next_step_ = 0;
  // A micro-batch's tokens and targets as the data give them (host), and
  // their copies in the state device's memory, which the stage reads.
  std::vector<int32_t> tokens_, targets_;
  StateArray<int32_t> stage_tokens_, stage_targets_;
};

}  // namespace meshrun::train
