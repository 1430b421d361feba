// One pipeline stage this rank trains: the model plugin's stage adapted to
// the executor (pipeline::StageWork), and its FSDP2 sharding over the
// data-parallel axis (pipeline::StageSharding) through the strategy's ABI
// 1.3 hooks: UNSHARD gathers every unit of the stage and keeps it gathered
// for all of the step's microbatches (with pp, FSDP2 reshards nothing after
// forward), REDUCE_GRAD reduce-scatters each unit's accumulated gradients.
// The model's own unit-boundary calls then only look up the gathered views.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/model.hpp"
#include "pipeline/stage_work.hpp"
#include "strategy/strategy.hpp"
#include "train/hooks.hpp"

namespace meshrun::train {

class PipelineStage : public pipeline::StageWork,
                      public pipeline::StageSharding,
                      public StageHooks {
 public:
  // `loss_scale`: what the last stage seeds its backward with per
  // microbatch (1/m with scale_grads_in_schedule, else 1); `after_forward`
  // is called after each forward; `local`: the tp-local shapes
  // (model/tensor_parallel.hpp). Everything passed in must outlive the
  // stage.
  // `parts`: the strategies of the stage's parameters (a mixture of
  // experts' dense ones and its experts), each sharding its own.
  PipelineStage(const Model& model, const ModelDescription& local,
                const std::vector<std::string>& modules, const std::vector<StrategyPart>& parts,
                const StageCommunicators& computing, const std::string& plan_json,
                const std::string& options_json, float loss_scale, const StageDevice& device,
                std::function<void()> after_forward);

  ModelStage& compute() { return stage_; }

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

  ParameterStorage parameter(int64_t parameter, bool backward) override;

 private:
  PartBindings bindings_;
  ModelStage stage_;
  float loss_scale_;
  std::function<void()> after_forward_;
  const int32_t* tokens_ = nullptr;
  const int32_t* targets_ = nullptr;
  int64_t rows_ = 0;
  double loss_sum_ = 0;
};

}  // namespace meshrun::train
