#include "train/pipeline_stage.hpp"

#include <utility>

#include "train/hooks.hpp"

namespace meshrun::train {

StrategyUnits stage_units(const llama::LlamaStage& stage) {
  const llama::StageLayout& layout = stage.layout();
  const auto layers = int32_t(layout.end_layer - layout.first_layer);
  const bool has_root = layout.embedding || layout.head;
  StrategyUnits units;
  units.num_units = layers + (has_root ? 1 : 0);
  units.root_unit = has_root ? layers : 0;
  const std::string prefix = "model.layers.";
  for (const auto& view : stage.parameters()) {
    int32_t unit = units.root_unit;
    if (view.name.rfind(prefix, 0) == 0) {
      unit = int32_t(std::stoll(view.name.substr(prefix.size())) - layout.first_layer);
    }
    units.parameter_units.push_back(unit);
    units.parameter_rows.push_back(view.shape.front());
  }
  return units;
}

PipelineStage::PipelineStage(llama::LlamaStage& stage, Strategy& strategy,
                             const StrategyUnits& units, float loss_scale)
    : stage_(stage),
      strategy_(strategy),
      unit_parameters_(size_t(units.num_units)),
      loss_scale_(loss_scale) {
  for (size_t p = 0; p < units.parameter_units.size(); ++p) {
    unit_parameters_[size_t(units.parameter_units[p])].push_back(int(p));
  }
}

void PipelineStage::set_batch(const int32_t* tokens, const int32_t* targets, int64_t rows) {
  tokens_ = tokens;
  targets_ = targets;
  rows_ = rows;
}

double PipelineStage::take_loss_sum() { return std::exchange(loss_sum_, 0.0); }

void PipelineStage::bind(int32_t unit, bool gradients) {
  bind_unit(strategy_, unit, unit_parameters_[size_t(unit)], stage_.parameters(), gradients);
}

void PipelineStage::gather_for_evaluation() {
  for (int32_t unit = 0; unit < int32_t(unit_parameters_.size()); ++unit) {
    strategy_.pre_forward(unit);
    bind(unit, false);
    strategy_.post_forward(unit);
  }
}

void PipelineStage::forward(int32_t microbatch, const float* input, float* output) {
  const int64_t at = int64_t(microbatch) * rows_;
  loss_sum_ += stage_.forward(microbatch, tokens_ + at, targets_ + at, input, output);
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
  strategy_.begin_micro_batch(true);
  for (int32_t unit = 0; unit < int32_t(unit_parameters_.size()); ++unit) {
    strategy_.pre_forward(unit);
    strategy_.post_forward(unit);
    strategy_.pre_backward(unit);
    bind(unit, true);
  }
}

void PipelineStage::reduce_grad() {
  for (int32_t unit = int32_t(unit_parameters_.size()) - 1; unit >= 0; --unit) {
    strategy_.post_backward(unit);
  }
}

}  // namespace meshrun::train
