#include "train/hooks.hpp"

#include <fmt/format.h>

#include <tuple>

#include "errors.hpp"

namespace meshrun::train {

StageUnits stage_units(const ModelDescription& d, const StageContents& contents) {
  StageUnits units;
  const StrategyUnitNumbers numbers = strategy_unit_numbers(d, contents.units);
  units.of_model_unit = numbers.of_model_unit;
  units.strategy.num_units = numbers.num_units;
  units.strategy.root_unit = numbers.root_unit;
  std::vector<int64_t> unit_numel(size_t(units.strategy.num_units), 0);
  for (const int64_t p : contents.parameters) {
    const ModelParameter& parameter = d.parameters[size_t(p)];
    const int32_t unit = units.of_model_unit[size_t(parameter.unit)];
    units.strategy.parameter_units.push_back(unit);
    units.strategy.parameter_rows.push_back(parameter.shape.front());
    units.offset_in_unit.push_back(unit_numel[size_t(unit)]);
    unit_numel[size_t(unit)] += parameter.numel;
  }
  return units;
}

void ReplicatedHooks::gradient_ready(int64_t parameter) {
  const int64_t k = parameters_.position[size_t(parameter)];
  timed("gradients_ready", int32_t(parameter), [&] {
    strategy_.gradients_ready(parameters_.offsets[size_t(k)], parameters_.offsets[size_t(k) + 1]);
  });
}

ParameterStorage ReplicatedHooks::parameter(int64_t parameter, bool backward) {
  const int64_t offset = parameters_.offsets[size_t(parameters_.position[size_t(parameter)])];
  return {parameters_.values.data() + offset,
          backward ? parameters_.gradients.data() + offset : nullptr};
}

UnitBinding::UnitBinding(Strategy& strategy, const StageUnits& units,
                         const std::vector<int64_t>& parameters, size_t description_parameters)
    : strategy_(strategy),
      units_(units),
      views_(size_t(units.strategy.num_units)),
      stage_position_(description_parameters, -1) {
  for (size_t k = 0; k < parameters.size(); ++k)
    stage_position_[size_t(parameters[k])] = int64_t(k);
}

void UnitBinding::bind(int32_t strategy_unit) {
  Views& views = views_[size_t(strategy_unit)];
  std::tie(views.parameters, views.gradients) = strategy_.unit_views(strategy_unit);
  views.bfloat16 = strategy_.unit_views_bfloat16(strategy_unit);
}

ParameterStorage UnitBinding::storage(int64_t parameter, bool backward) const {
  const auto k = size_t(stage_position_[size_t(parameter)]);
  const Views& views = views_[size_t(units_.strategy.parameter_units[k])];
  const int64_t offset = units_.offset_in_unit[k];
  if (views.parameters.data == nullptr || (backward && views.gradients.data == nullptr)) {
    throw Error(MESHRUN_FAILED_PRECONDITION,
                fmt::format("the strategy holds no gathered {} for stage parameter {}",
                            backward ? "gradients" : "parameters", k));
  }
  return {views.parameters.data + offset, backward ? views.gradients.data + offset : nullptr,
          views.bfloat16.data != nullptr ? views.bfloat16.data + offset : nullptr};
}

PartBindings::PartBindings(const std::vector<StrategyPart>& parts, size_t description_parameters)
    : part_of_(description_parameters, -1) {
  for (const StrategyPart& part : parts) {
    for (const int64_t p : part.parameters) part_of_[size_t(p)] = int32_t(parts_.size());
    parts_.push_back(std::make_unique<Bound>(part, description_parameters));
  }
}

ParameterStorage PartBindings::storage(int64_t parameter, bool backward) const {
  const int32_t part = part_of_[size_t(parameter)];
  if (part < 0) {
    throw Error(
        MESHRUN_OUT_OF_RANGE,
        fmt::format("this rank holds no parameter {} (another ep rank's expert?)", parameter));
  }
  return parts_[size_t(part)]->binding.storage(parameter, backward);
}

ShardedHooks::ShardedHooks(const std::vector<StrategyPart>& parts, size_t description_parameters,
                           const MixedPrecisionConfig& precision, StateDevice& state)
    : bindings_(parts, description_parameters), precision_(precision), state_(state) {}

template <class Call>
void ShardedHooks::each_part(const char* hook, int32_t unit, bool bind, Call&& call) {
  for (auto& part : bindings_.parts()) {
    const int32_t strategy_unit = part->binding.units().of_model_unit[size_t(unit)];
    if (strategy_unit < 0) continue;
    timed(hook, unit, [&] { call(part->strategy, strategy_unit); });
    if (bind) part->binding.bind(strategy_unit);
  }
}

// FSDP2's MixedPrecisionPolicy on a layer unit computed in float32: its
// inputs are cast to param_dtype (cast_forward_inputs), its outputs carry the
// compute dtype's precision and are then cast to output_dtype. The root has
// no hidden states to cast.
void ShardedHooks::pre_forward(int32_t unit, float* hidden, int64_t numel) {
  each_part("pre_forward", unit, true,
            [](Strategy& strategy, int32_t u) { strategy.pre_forward(u); });
  if (precision_.cast_forward_inputs) state_.round_to(hidden, numel, precision_.param_dtype);
}

void ShardedHooks::post_forward(int32_t unit, float* hidden, int64_t numel) {
  state_.round_to(hidden, numel, precision_.param_dtype);
  state_.round_to(hidden, numel, precision_.output_dtype);
  each_part("post_forward", unit, false,
            [](Strategy& strategy, int32_t u) { strategy.post_forward(u); });
}

void ShardedHooks::pre_backward(int32_t unit) {
  each_part("pre_backward", unit, true,
            [](Strategy& strategy, int32_t u) { strategy.pre_backward(u); });
}

void ShardedHooks::post_backward(int32_t unit) {
  each_part("post_backward", unit, false,
            [](Strategy& strategy, int32_t u) { strategy.post_backward(u); });
}

ParameterStorage ShardedHooks::parameter(int64_t parameter, bool backward) {
  return bindings_.storage(parameter, backward);
}

}  // namespace meshrun::train
