// One pipeline stage this rank trains: the Llama stage's compute adapted to
// the executor (pipeline::StageWork), and its FSDP2 sharding over the
// data-parallel axis (pipeline::StageSharding) through the strategy's ABI
// 1.3 hooks: UNSHARD gathers every unit of the stage and keeps it gathered
// for all of the step's microbatches (with pp, FSDP2 reshards nothing after
// forward), REDUCE_GRAD reduce-scatters each unit's accumulated gradients.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "llama/stage.hpp"
#include "pipeline/stage_work.hpp"
#include "strategy/strategy.hpp"

namespace meshrun::train {

// The stage's units as the strategy numbers them: its decoder layers
// 0..k-1 in order, then the root (embedding, final norm, lm_head) when the
// stage holds any of them, else the root is its first layer.
StrategyUnits stage_units(const llama::LlamaStage& stage);

class PipelineStage : public pipeline::StageWork, public pipeline::StageSharding {
 public:
  // `loss_scale`: what the last stage seeds its backward with per
  // microbatch (1/m with scale_grads_in_schedule, else 1).
  PipelineStage(llama::LlamaStage& stage, Strategy& strategy, const StrategyUnits& units,
                float loss_scale);

  // The step's tokens and targets: microbatch k is rows [k * rows, (k+1) *
  // rows) of both, rows = batch * seq_len; they must outlive the step.
  void set_batch(const int32_t* tokens, const int32_t* targets, int64_t rows);
  // The sum of the microbatch losses since the last call (last stage).
  double take_loss_sum();

  // Gathers the stage's units for a forward outside a step (evaluation).
  void gather_for_evaluation();

  int64_t input_numel() const override { return stage_.input_numel(); }
  int64_t output_numel() const override { return stage_.output_numel(); }
  void forward(int32_t microbatch, const float* input, float* output) override;
  void backward(int32_t microbatch, const float* grad_output, float* grad_input) override;
  void backward_input(int32_t microbatch, const float* grad_output, float* grad_input) override;
  void backward_weight(int32_t microbatch) override;

  void unshard() override;
  void reshard() override {}
  void reduce_grad() override;

 private:
  // Points the views of the unit's parameters (and gradients) at the
  // strategy's storage.
  void bind(int32_t unit, bool gradients);

  llama::LlamaStage& stage_;
  Strategy& strategy_;
  std::vector<std::vector<int>> unit_parameters_;
  float loss_scale_;
  const int32_t* tokens_ = nullptr;
  const int32_t* targets_ = nullptr;
  int64_t rows_ = 0;
  double loss_sum_ = 0;
};

}  // namespace meshrun::train
