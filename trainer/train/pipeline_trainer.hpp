// The training of one rank of a pipeline-parallel run (pp > 1): the stages
// the plan's split puts on this rank, each an FSDP2-sharded model stage
// over the data-parallel axis, run by the executor through the schedule
// (a schedule plugin or pp_schedule_csv, lowered and validated), with AdamW
// on each stage's local shard. The state, the activations and the tokens
// are memory of the rank's state device: the host's, or its GPU's in a
// CUDA run (whose GPU half has compiled and never run on a GPU).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "pipeline/executor.hpp"
#include "plan/plan.hpp"
#include "schedule/schedule.hpp"
#include "state/checkpoint.hpp"
#include "state/local_parameters.hpp"
#include "state/optimizer.hpp"
#include "strategy/strategy.hpp"
#include "train/data.hpp"
#include "train/loop.hpp"
#include "train/pipeline_stage.hpp"
#include "train/rank_worlds.hpp"

namespace meshrun::train {

struct PipelineContext {
  const Config& config;
  const TokenData& data;
  const Plan& plan;
  // The two worlds and their axes (rank_worlds.hpp): the host's for the
  // trainer's own collectives (the loss, the norm's shares, validation
  // sums, the router statistics, checkpoints, the export), the state's for
  // the strategies, the executor's transfers over pp and the model's tp, cp
  // and ep. One world on the CPU.
  RankComms comms;
  RankDevice device;
  std::string strategy_options;  // the strategy's JSON options
  std::string output_dir;
  GemmPeakMeter gemm_peak;
};

// The schedule the config asks for on `pp` ranks with `stages` stages and
// `microbatches` microbatches, with communication and FSDP2's sharding
// actions, validated.
schedule::Schedule pipeline_schedule(const Config& config, const Plan& plan, int64_t pp,
                                     int64_t stages, int64_t microbatches);

class PipelineTrainer : public TrainingRank {
 public:
  explicit PipelineTrainer(PipelineContext context);
  ~PipelineTrainer() override;

  void resume(const CheckpointIndex& index);
  void run(const StepObserver& observer = {});

  void train_step(int64_t step, StepMetrics& metrics) override;
  double gradient_norm() override;
  void optimizer_step(const StepMetrics& metrics) override;
  std::optional<int64_t> first_nonfinite_gradient() override;
  std::optional<double> validate() override;
  MemoryUse memory_use() override;
  void save_checkpoint(int64_t step) override;
  void export_weights() override;

 private:
  struct Held;
  struct HeldPart;
  // A strategy over `contents` of `held`'s stage, sharding over `groups`
  // (the state's), its shard's ranges over their host twins `host`, and
  // its AdamW.
  HeldPart& add_part(Held& held, const StageContents& contents, const StrategyGroups& groups,
                     const StrategyGroups& host, const std::string& options);
  void build_stages();
  double forward_for_evaluation(int64_t count);
  double all_reduce(double value, ReduceOp op, Communicator& over);
  // Whether this rank adds the loss and the weights of its stage (tp and cp
  // ranks hold the same).
  bool counts_model_result() const;
  // Elements [begin, end) of the stage's local shard in the full model's
  // flat layout, and the rank's local shards and moments concatenated.
  std::vector<HeldRange> rank_ranges(bool saved) const;
  TensorParallelRank tensor_parallel() const {
    return {*ctx_.plan.tensor_parallel, host_axis(Axis::tp)};
  }
  Communicator& host_axis(Axis axis) const { return ctx_.comms.host.axis(axis); }
  Communicator& state_axis(Axis axis) const { return ctx_.comms.state.axis(axis); }
  // With expert parallelism the experts have a strategy of their own over
  // ep_shard (ExpertPlacement, experts.hpp).
  bool expert_parallel() const;
  std::vector<ShardState> shard_states();
  // Samples what the rank's stages hold for backward together.
  void sample_activations();

  PipelineContext ctx_;
  // Where the shards, gradients and moments the optimizer updates are, the
  // activations, and the step's arithmetic on them.
  StateDevice& state_;
  StageCommunicators computing_;               // the state's tp, cp and ep
  std::optional<ExpertGroups> expert_groups_;  // with expert parallelism
  int64_t microbatches_ = 0;
  std::vector<std::unique_ptr<Held>> held_;
  std::optional<pipeline::Executor> executor_;
  ActivationMeter activations_;
  int64_t next_step_ = 0;
  std::vector<int32_t> tokens_, targets_;
  StateArray<int32_t> stage_tokens_, stage_targets_;  // the state's copies
};

}  // namespace meshrun::train
