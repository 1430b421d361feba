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
#include "strategy/strategy.hpp"
#include "train/checkpoint.hpp"
#include "train/data.hpp"
#include "train/hooks.hpp"
#include "train/local_parameters.hpp"
#include "train/loop.hpp"
#include "train/metrics.hpp"
#include "train/optimizer.hpp"

namespace meshrun::train {

// What a rank trains with; everything outlives the Trainer.
struct TrainContext {
  const Config& config;
  const TokenData& data;
  const Model& model;
  const std::vector<std::string>& modules;  // all of the model's
  Strategy& strategy;
  FlatParameters& parameters;  // the replicated storage (released under a sharded strategy)
  const StageUnits& units;     // for a sharded strategy's hooks
  Communicator& world;
  Communicator& data_parallel;
  Communicator& shard_group;      // dp_shard_cp
  Communicator& replicate_group;  // dp_replicate
  StageCommunicators computing;   // the axes the model computes over
  const TensorParallelLayout& tensor_parallel;
  std::string plan_json;     // the model plan
  std::string options_json;  // the strategy options
  std::string output_dir;
};

class Trainer : public TrainingRank {
 public:
  explicit Trainer(TrainContext context);

  // Continues from a sharded checkpoint: parameters, AdamW moments and the
  // step. Sampling depends only on (seed, step), so that is all the state.
  void resume(const CheckpointIndex& index);
  // Trains up to train.steps; rank 0 writes metrics.jsonl and, at the end,
  // the consolidated checkpoint.
  void run();

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
  double all_reduce(double value, ReduceOp op);
  double evaluate(int64_t count);
  std::vector<FlatBuffer> checkpoint_buffers();
  TensorParallelRank tensor_parallel() const { return {ctx_.tensor_parallel, *ctx_.computing.tp}; }

  TrainContext ctx_;
  std::unique_ptr<TimedHooks> hooks_;
  ModelStage stage_;
  LocalParameters local_;
  // local_'s ranges in the full model's flat layout: all it holds, and what
  // it saves.
  std::vector<HeldRange> model_held_, model_saved_;
  AdamW optimizer_;
  ActivationMeter activations_;
  int64_t next_step_ = 0;
  std::vector<int32_t> tokens_, targets_;
};

}  // namespace meshrun::train
