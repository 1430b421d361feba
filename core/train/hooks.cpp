#include "train/hooks.hpp"

#include <fmt/format.h>

#include <map>
#include <utility>

#include "errors.hpp"
#include "tensor/elements.hpp"

namespace meshrun::train {
namespace {

// Rounds float32 values to `dtype` ("float32" leaves them), kept as float32:
// what a 16-bit compute dtype does to the values it holds.
void round_to(float* values, int64_t count, const std::string& dtype) {
  if (dtype == "bfloat16") {
    for (int64_t i = 0; i < count; ++i) values[i] = bfloat16_to_float(float_to_bfloat16(values[i]));
  } else if (dtype == "float16") {
    for (int64_t i = 0; i < count; ++i) values[i] = float(static_cast<_Float16>(values[i]));
  }
}

}  // namespace

std::vector<ElementRange> parameter_ranges(const llama::LlamaModel& model) {
  std::vector<ElementRange> ranges;
  int64_t offset = 0;
  for (const auto& view : model.parameters()) {
    ranges.push_back({offset, offset + view.numel});
    offset += view.numel;
  }
  return ranges;
}

void StrategyHooks::gradient_ready(int parameter) {
  const auto& [begin, end] = ranges_[static_cast<size_t>(parameter)];
  timed([&] { strategy_.gradients_ready(begin, end); });
}

double StrategyHooks::take_seconds_in_strategy() {
  return std::exchange(seconds_in_strategy_, 0.0);
}

StrategyUnits model_units(const nlohmann::ordered_json& plan_units,
                          const llama::LlamaModel& model) {
  const auto layers = int32_t(model.config().num_hidden_layers);
  std::map<std::string, int> index_of;
  for (size_t p = 0; p < model.parameters().size(); ++p) {
    index_of[model.parameters()[p].name] = int(p);
  }
  StrategyUnits units;
  units.num_units = layers + 1;
  units.root_unit = layers;
  units.parameter_units.assign(model.parameters().size(), -1);
  int32_t next_layer = 0;
  for (const auto& unit : plan_units) {
    const auto name = unit.at("name").get<std::string>();
    const int32_t number = name == "root" ? units.root_unit : next_layer++;
    const std::string prefix = fmt::format("model.layers.{}.", number);
    for (const auto& parameter : unit.at("parameters")) {
      const auto found = index_of.find(parameter.get<std::string>());
      const bool in_layer = found != index_of.end() && found->first.rfind(prefix, 0) == 0;
      const bool in_root = found != index_of.end() && found->first.rfind("model.layers.", 0) != 0;
      if (number < units.root_unit ? !in_layer : !in_root) {
        throw invalid_argument(fmt::format(
            "the sidecar's unit '{}' holds '{}', which is not a parameter of {} of the model", name,
            parameter.get<std::string>(),
            number < units.root_unit ? fmt::format("decoder layer {}", number) : "the root"));
      }
      units.parameter_units[size_t(found->second)] = number;
    }
  }
  for (size_t p = 0; p < units.parameter_units.size(); ++p) {
    if (units.parameter_units[p] < 0) {
      throw invalid_argument(fmt::format("the sidecar's plan puts parameter '{}' in no unit",
                                         model.parameters()[p].name));
    }
    units.parameter_rows.push_back(model.parameters()[p].shape.front());
  }
  return units;
}

ShardedHooks::ShardedHooks(Strategy& strategy, llama::LlamaModel& model, const StrategyUnits& units,
                           const MixedPrecisionConfig& precision)
    : StrategyHooks(strategy, model),
      strategy_(strategy),
      model_(model),
      root_unit_(units.root_unit),
      unit_parameters_(size_t(units.num_units)),
      precision_(precision) {
  for (size_t p = 0; p < units.parameter_units.size(); ++p) {
    unit_parameters_[size_t(units.parameter_units[p])].push_back(int(p));
  }
}

void bind_unit(Strategy& strategy, int32_t unit, const std::vector<int>& parameters,
               std::vector<llama::ParameterView>& views, bool gradients) {
  const auto [params, grads] = strategy.unit_views(unit);
  int64_t offset = 0;
  for (const int p : parameters) {
    llama::ParameterView& view = views[size_t(p)];
    view.data = params.data + offset;
    view.grad = gradients ? grads.data + offset : nullptr;
    offset += view.numel;
  }
}

void ShardedHooks::bind(int32_t unit, bool gradients) {
  bind_unit(strategy_, unit, unit_parameters_[size_t(unit)], model_.parameters(), gradients);
}

void ShardedHooks::round_hidden_states(int64_t layer, const std::string& dtype) {
  round_to(model_.hidden_states(layer), model_.hidden_states_numel(), dtype);
}

// FSDP2's MixedPrecisionPolicy on a decoder layer computed in float32: its
// inputs are cast to param_dtype (cast_forward_inputs), its outputs carry the
// compute dtype's precision and are then cast to output_dtype.
void ShardedHooks::pre_forward(int unit) {
  timed([&] { strategy_.pre_forward(strategy_unit(unit)); });
  bind(strategy_unit(unit), false);
  if (unit != llama::kRootUnit && precision_.cast_forward_inputs) {
    round_hidden_states(unit, precision_.param_dtype);
  }
}

void ShardedHooks::post_forward(int unit) {
  if (unit != llama::kRootUnit) {
    round_hidden_states(unit + 1, precision_.param_dtype);
    round_hidden_states(unit + 1, precision_.output_dtype);
  }
  timed([&] { strategy_.post_forward(strategy_unit(unit)); });
}

void ShardedHooks::pre_backward(int unit) {
  timed([&] { strategy_.pre_backward(strategy_unit(unit)); });
  bind(strategy_unit(unit), true);
}

void ShardedHooks::post_backward(int unit) {
  timed([&] { strategy_.post_backward(strategy_unit(unit)); });
}

}  // namespace meshrun::train
