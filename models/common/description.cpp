#include "common/description.hpp"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace meshrun::models {

namespace {

using nlohmann::ordered_json;

ordered_json module_json(const ModuleSpec& module) {
  ordered_json json = {{"name", module.name}, {"parameters", module.parameters}};
  if (!module.group.empty()) json["group"] = module.group;
  return json;
}

// How many of `names` are among `modules`; throws unless none or all.
int64_t count_whole(const std::vector<ModuleSpec>& modules, const std::vector<std::string>& names,
                    const char* family) {
  std::string all;
  int64_t count = 0;
  for (const ModuleSpec& module : modules) {
    all += (all.empty() ? "" : " and ") + module.name;
    count += std::count(names.begin(), names.end(), module.name);
  }
  if (count != 0 && count != int64_t(modules.size())) {
    throw std::invalid_argument(std::string(family) + ": " + all + " must be on one stage");
  }
  return count;
}

bool named_in(const std::vector<ModuleSpec>& modules, const std::string& name) {
  return std::any_of(modules.begin(), modules.end(),
                     [&](const ModuleSpec& module) { return module.name == name; });
}

}  // namespace

std::string describe_model(ordered_json fields, const std::vector<ParameterView>& parameters,
                           int64_t num_layers, const ModelModules& modules) {
  const DecoderUnits decoder(num_layers);
  const auto unit_name = [&](int64_t unit) {
    if (unit < num_layers) return modules.layer_prefix + std::to_string(unit);
    return std::string(unit == decoder.embedding ? "embedding"
                       : unit == decoder.head    ? "head"
                                                 : "root");
  };
  ordered_json units = ordered_json::array(), kinds = ordered_json::array();
  for (int64_t unit = 0; unit <= decoder.root; ++unit) {
    units.push_back(unit_name(unit));
    kinds.push_back(unit < num_layers ? "layer" : unit_name(unit));
  }
  ordered_json described = ordered_json::array();
  ordered_json module_list = ordered_json::array();
  for (const ModuleSpec& module : modules.embedding) module_list.push_back(module_json(module));
  for (const ParameterView& p : parameters) {
    described.push_back({{"name", p.name}, {"shape", p.shape}, {"unit", unit_name(p.unit)}});
    if (p.tp != "replicate") described.back()["tp"] = p.tp;
    if (p.expert >= 0) described.back()["expert"] = p.expert;
    if (p.unit >= num_layers) continue;
    if (module_list.back()["name"] != unit_name(p.unit)) {
      module_list.push_back({{"name", unit_name(p.unit)}, {"parameters", ordered_json::array()}});
    }
    module_list.back()["parameters"].push_back(p.name);
  }
  for (const ModuleSpec& module : modules.head) module_list.push_back(module_json(module));
  fields["parameters"] = std::move(described);
  fields["units"] = std::move(units);
  fields["unit_kinds"] = std::move(kinds);
  fields["modules"] = std::move(module_list);
  return fields.dump();
}

nlohmann::ordered_json activations_json(const ActivationsPerToken& a, const Float32PerToken& f) {
  const auto pair = [](int64_t whole, int64_t split) {
    return ordered_json{{"whole", whole}, {"tp_split", split}};
  };
  return {{"layer", pair(a.layer_whole, a.layer_split)},
          {"elementwise", pair(a.elementwise_whole, a.elementwise_split)},
          {"stream", a.stream},
          {"head", pair(a.head_whole, a.head_split)},
          {"float32",
           {{"layer", pair(f.layer_whole, f.layer_split)},
            {"elementwise", pair(f.elementwise_whole, f.elementwise_split)},
            {"head", pair(f.head_whole, f.head_split)}}}};
}

nlohmann::ordered_json flops_json(int64_t matmul_parameters, int64_t attention_layers,
                                  int64_t attention_width, const std::vector<GemmShape>& gemms) {
  ordered_json shapes = ordered_json::array();
  for (const GemmShape& gemm : gemms) {
    ordered_json shape = {{"k", gemm.k}, {"n", gemm.n}, {"count", gemm.count}};
    if (gemm.rows != 1.0) shape["rows"] = gemm.rows;
    if (gemm.tp[0] != '\0') shape["tp"] = gemm.tp;
    shapes.push_back(std::move(shape));
  }
  ordered_json flops = {{"matmul_parameters", matmul_parameters},
                        {"attention", {{"layers", attention_layers}, {"width", attention_width}}}};
  if (!shapes.empty()) flops["gemms"] = std::move(shapes);
  return flops;
}

nlohmann::ordered_json tp_blocks_json(const std::vector<BlockSpec>& specs) {
  ordered_json blocks = ordered_json::array();
  for (const BlockSpec& spec : specs) {
    ordered_json modules = ordered_json::object();
    for (const auto& [module, style] : spec.modules) modules[module] = style;
    blocks.push_back({{"name", block_name(spec.block)}, {"modules", std::move(modules)}});
  }
  return blocks;
}

StageLayout stage_layout(const ModelModules& modules, int64_t num_layers,
                         const std::vector<std::string>& names, const char* family) {
  StageLayout layout{-1, -1, count_whole(modules.embedding, names, family) > 0,
                     count_whole(modules.head, names, family) > 0};
  for (const std::string& name : names) {
    if (named_in(modules.embedding, name) || named_in(modules.head, name)) continue;
    if (name.rfind(modules.layer_prefix, 0) != 0) {
      throw std::invalid_argument(std::string(family) + ": no module '" + name + "'");
    }
    const int64_t l = std::stoll(name.substr(modules.layer_prefix.size()));
    if (layout.first_layer < 0) layout.first_layer = l;
    layout.end_layer = l + 1;
  }
  if (layout.first_layer < 0) {
    layout.first_layer = layout.end_layer = layout.embedding ? 0 : num_layers;
  }
  return layout;
}

Checkpointing checkpointed_layers(const ModelModules& modules, int64_t num_layers,
                                  const char* plan_json, const char* family) {
  Checkpointing layers;
  if (plan_json == nullptr || *plan_json == '\0') return layers;
  const auto plan = nlohmann::json::parse(plan_json, nullptr, /*allow_exceptions=*/false);
  const auto refuse = [&](const std::string& why) {
    throw std::invalid_argument(std::string(family) +
                                ": the plan's activation_checkpointing: " + why);
  };
  if (!plan.is_object()) refuse("the plan is not a JSON object");
  for (const auto& entry : plan.value("activation_checkpointing", nlohmann::json::array())) {
    const std::string name = entry.value("module", ""), mode = entry.value("mode", "");
    if (mode != "full" && mode != "selective") {
      refuse("mode '" + mode + "' of " + name + ": \"full\" or \"selective\" recompute");
    }
    const std::string digits = name.substr(std::min(name.size(), modules.layer_prefix.size()));
    const bool layer = name.rfind(modules.layer_prefix, 0) == 0 && !digits.empty() &&
                       digits.find_first_not_of("0123456789") == std::string::npos &&
                       digits.size() < 10 && std::stoll(digits) < num_layers;
    if (!layer) refuse("'" + name + "' is not a layer's module");
    layers[std::stoll(digits)] = mode == "full" ? Recomputation::full : Recomputation::selective;
  }
  return layers;
}

kernels::MatmulPrecision planned_matmul_precision(const char* plan_json, const char* family) {
  if (plan_json == nullptr || *plan_json == '\0') return kernels::MatmulPrecision::float32;
  const auto plan = nlohmann::json::parse(plan_json, nullptr, /*allow_exceptions=*/false);
  const auto dtype = plan.is_object() ? plan.value("autocast_dtype", nlohmann::json()) : nullptr;
  if (dtype.is_null()) return kernels::MatmulPrecision::float32;
  if (dtype == "bfloat16") return kernels::MatmulPrecision::bfloat16;
  throw std::invalid_argument(std::string(family) + ": the plan's autocast_dtype " + dtype.dump() +
                              ": the model's matmuls compute in \"bfloat16\" under autocast");
}

}  // namespace meshrun::models
