#include "train/pipeline_stage.hpp"

#include <utility>

namespace meshrun::train {

PipelineStage::PipelineStage(const Model& model, const ModelDescription& local,
                             const std::vector<std::string>& modules,
                             const std::vector<StrategyPart>& parts,
                             const StageCommunicators& computing, const std::string& plan_json,
                             const std::string& options_json, float loss_scale,
                             const StageDevice& device, std::function<void()> after_forward)
    : bindings_(parts, model.description().parameters.size()),
      stage_(model, modules, *this, computing, plan_json, options_json, &local, device),
      loss_scale_(loss_scale),
      after_forward_(std::move(after_forward)) {}

void PipelineStage::set_batch(const int32_t* tokens, const int32_t* targets, int64_t rows) {
  tokens_ = tokens;
  targets_ = targets;
  rows_ = rows;
}

double PipelineStage::take_loss_sum() { return std::exchange(loss_sum_, 0.0); }

void PipelineStage::gather_for_evaluation() {
  for (auto& part : bindings_.parts()) {
    for (int32_t unit = 0; unit < part->binding.units().strategy.num_units; ++unit) {
      part->strategy.pre_forward(unit);
      part->binding.bind(unit);
      part->strategy.post_forward(unit);
    }
  }
}

void PipelineStage::forward(int32_t microbatch, const float* input, float* output) {
  const int64_t at = int64_t(microbatch) * rows_;
  loss_sum_ += stage_.forward(microbatch, tokens_ + at, targets_ + at, input, output);
  after_forward_();
}

void PipelineStage::backward(int32_t microbatch, const float* grad_output, float* grad_input) {
  stage_.backward(microbatch, loss_scale_, grad_output, grad_input);
}

void PipelineStage::backward_input(int32_t microbatch, const float* grad_output,
                                   float* grad_input) {
  stage_.backward_input(microbatch, loss_scale_, grad_output, grad_input);
}

void PipelineStage::backward_weight(int32_t microbatch) { stage_.backward_weight(microbatch); }

// The step's one micro-batch, as the strategy sees it: every unit gathered
// (forward hooks; with pp nothing reshards after forward) and given its
// gradient buffer (backward hooks) for all the schedule's microbatches.
void PipelineStage::unshard() {
  for (auto& part : bindings_.parts()) {
    part->strategy.begin_micro_batch(true);
    for (int32_t unit = 0; unit < part->binding.units().strategy.num_units; ++unit) {
      part->strategy.pre_forward(unit);
      part->strategy.post_forward(unit);
      part->strategy.pre_backward(unit);
      part->binding.bind(unit);
    }
  }
}

void PipelineStage::reduce_grad() {
  for (auto& part : bindings_.parts()) {
    for (int32_t unit = part->binding.units().strategy.num_units - 1; unit >= 0; --unit) {
      part->strategy.post_backward(unit);
    }
  }
}

ParameterStorage PipelineStage::parameter(int64_t parameter, bool backward) {
  return bindings_.storage(parameter, backward);
}

}  // namespace meshrun::train
