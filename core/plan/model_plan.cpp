// The plan of the model (docs/plan.md): the default plan every model gets
// from its description (units, replicated placement, AutoModel's pipeline
// split, the activation-checkpoint set), refined by the model family's
// sidecar when one is installed, and checked against the description
// whichever made it.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "errors.hpp"
#include "meshrun/sidecar.h"
#include "plan/plan.hpp"
#include "plan/tp_plan.hpp"
#include "plugin/call_scope.hpp"

namespace meshrun {
namespace {

using nlohmann::ordered_json;

[[noreturn]] void reject(const std::string& key, const std::string& reason) {
  throw Error(MESHRUN_INVALID_ARGUMENT, key + ": " + reason, key);
}

bool is_layer(const ModelDescription& d, const ModelModule& module) {
  return !module.parameters.empty() &&
         std::all_of(module.parameters.begin(), module.parameters.end(),
                     [&](int64_t p) { return d.is_layer_unit(d.parameters[size_t(p)].unit); });
}

// Stage count per AutoModel: one per rank (times the schedule's stages per
// rank) unless layers_per_stage says, rounded to a multiple of pp as asked.
int64_t stage_count(int64_t layers, int64_t pp, const PipelineConfig& p, int64_t per_rank) {
  if (p.layers_per_stage <= 0) return pp * per_rank;
  const int64_t stages = (layers + p.layers_per_stage - 1) / p.layers_per_stage;
  if (stages % pp == 0) return stages;
  if (p.round_virtual_stages_to_pp_multiple == "up") return (stages / pp + 1) * pp;
  if (p.round_virtual_stages_to_pp_multiple == "down" && stages >= pp) return stages / pp * pp;
  reject("distributed.pipeline.layers_per_stage",
         fmt::format("{} layers per stage give {} stages, not a multiple of distributed.pp_size = "
                     "{}; set round_virtual_stages_to_pp_multiple = \"up\" or \"down\"",
                     p.layers_per_stage, stages, pp));
}

// Layer modules split evenly over the stages, the remainder to the first
// stages; modules before the first layer go to the first stage, those after
// the last layer to the last, those between layers with the layer before.
std::vector<std::vector<std::string>> even_parts(const ModelDescription& d, int64_t stages,
                                                 const std::string& layers_key) {
  std::vector<size_t> layer_modules;
  for (size_t m = 0; m < d.modules.size(); ++m) {
    if (is_layer(d, d.modules[m])) layer_modules.push_back(m);
  }
  const auto layers = int64_t(layer_modules.size());
  if (stages > layers) {
    reject(layers_key, fmt::format("{} layers cannot fill {} pipeline stages", layers, stages));
  }
  std::vector<std::vector<std::string>> parts(static_cast<size_t>(stages));
  size_t next_layer = 0;
  for (int64_t s = 0; s < stages; ++s) {
    const int64_t count = layers / stages + (s < layers % stages ? 1 : 0);
    const size_t first = s == 0 ? 0 : layer_modules[next_layer];
    next_layer += size_t(count);
    const size_t end = s == stages - 1 ? d.modules.size() : layer_modules[next_layer];
    for (size_t m = first; m < end; ++m) parts[size_t(s)].push_back(d.modules[m].name);
  }
  return parts;
}

std::string module_order(const ModelDescription& d) {
  if (d.modules.size() <= 6) {
    std::string names;
    for (const auto& module : d.modules) names += (names.empty() ? "" : ", ") + module.name;
    return names;
  }
  return fmt::format("{}, {}, ..., {}, {}", d.modules[0].name, d.modules[1].name,
                     d.modules[d.modules.size() - 2].name, d.modules.back().name);
}

// module_fqns_per_model_part as given: every module once, in model order, no
// part empty, and a multiple of pp parts.
std::vector<std::vector<std::string>> explicit_parts(
    const ModelDescription& d, int64_t pp, const std::vector<std::vector<std::string>>& parts) {
  const std::string key = "distributed.pipeline.module_fqns_per_model_part";
  size_t next = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    if (parts[p].empty()) reject(key, fmt::format("part {} holds no module", p));
    for (const std::string& name : parts[p]) {
      if (next >= d.modules.size() || name != d.modules[next].name) {
        reject(key, fmt::format("part {} has '{}' where the model's next module is {} (every "
                                "module once, in model order: {})",
                                p, name,
                                next < d.modules.size() ? "'" + d.modules[next].name + "'" : "none",
                                module_order(d)));
      }
      ++next;
    }
  }
  if (next != d.modules.size()) {
    reject(key, fmt::format("'{}' is in no part", d.modules[next].name));
  }
  if (int64_t(parts.size()) % pp != 0) {
    reject(key, fmt::format("{} parts are not a multiple of distributed.pp_size = {}", parts.size(),
                            pp));
  }
  return parts;
}

// Modules of one group, and modules sharing a parameter, must be on one stage.
void check_inseparable(const ModelDescription& d,
                       const std::vector<std::vector<std::string>>& parts, const std::string& key) {
  std::map<std::string, size_t> stage_of_module;
  for (size_t s = 0; s < parts.size(); ++s) {
    for (const std::string& name : parts[s]) stage_of_module[name] = s;
  }
  std::map<std::string, std::pair<std::string, size_t>> group_stage;
  std::map<int64_t, std::pair<std::string, size_t>> parameter_stage;
  for (const ModelModule& module : d.modules) {
    const size_t stage = stage_of_module.at(module.name);
    if (!module.group.empty()) {
      const auto [it, first] = group_stage.emplace(module.group, std::pair{module.name, stage});
      if (!first && it->second.second != stage) {
        reject(key,
               fmt::format("modules '{}' and '{}' (group '{}') must be on one stage: the "
                           "split puts them on stages {} and {}",
                           it->second.first, module.name, module.group, it->second.second, stage));
      }
    }
    for (const int64_t p : module.parameters) {
      const auto [it, first] = parameter_stage.emplace(p, std::pair{module.name, stage});
      if (!first && it->second.second != stage) {
        reject(key, fmt::format("parameter '{}' is used by modules '{}' and '{}', which the "
                                "split puts on stages {} and {}: tied weights cannot be split "
                                "over pipeline stages",
                                d.parameters[size_t(p)].name, it->second.first, module.name,
                                it->second.second, stage));
      }
    }
  }
}

// Stage s runs on rank s mod pp, or for V schedules on ranks r and 2pp-1-r.
ordered_json pipeline_split(const Config& config, const ModelDescription& d, int64_t pp,
                            const PluginLibrary* schedule) {
  const PipelineConfig& p = config.distributed.pipeline;
  const int64_t per_rank = schedule != nullptr ? schedule->api().schedule->stages_per_rank : 1;
  const bool v_shape =
      schedule != nullptr && schedule->api().schedule->placement == MESHRUN_PLACEMENT_V;
  const bool given = !p.module_fqns_per_model_part.empty();
  const std::string layers_key =
      d.num_layers_key.empty() ? "distributed.pp_size" : d.num_layers_key;
  int64_t layers = 0;
  for (const auto& module : d.modules) layers += is_layer(d, module) ? 1 : 0;
  const auto parts = given ? explicit_parts(d, pp, p.module_fqns_per_model_part)
                           : even_parts(d, stage_count(layers, pp, p, per_rank), layers_key);
  check_inseparable(
      d, parts, given ? "distributed.pipeline.module_fqns_per_model_part" : "distributed.pp_size");
  ordered_json split = ordered_json::array();
  for (int64_t s = 0; s < int64_t(parts.size()); ++s) {
    const int64_t rank = v_shape && s >= pp ? 2 * pp - 1 - s : s % pp;
    split.push_back({{"stage", s}, {"rank", rank}, {"modules", parts[size_t(s)]}});
  }
  return split;
}

// The plan's "context_parallel": how the cp ranks share attention, null
// without cp.
ordered_json context_parallel(const Config& config) {
  if (config.distributed.cp_size == 1) return nullptr;
  const ContextParallelDegrees degrees = context_parallel_degrees(config);
  return {{"size", config.distributed.cp_size},
          {"ring_degree", degrees.ring},
          {"ulysses_degree", degrees.ulysses},
          {"chunks", 2 * config.distributed.cp_size}};
}

// The plan's "autocast_dtype": null for float32 matmuls.
ordered_json autocast_dtype(const Config& config, const ModelDescription& d) {
  const std::string dtype = matmul_dtype(config, d);
  return dtype == "float32" ? ordered_json(nullptr) : ordered_json(dtype);
}

ordered_json default_plan(const Config& config, const MeshContext& mesh, const ModelDescription& d,
                          const PluginLibrary* schedule) {
  // The root first, then the others in forward order.
  ordered_json units = ordered_json::array();
  std::vector<size_t> listed_at(d.units.size(), 0);
  units.push_back({{"name", "root"}, {"parameters", ordered_json::array()}});
  for (const int32_t u : d.forward_units()) {
    listed_at[size_t(u)] = units.size();
    units.push_back({{"name", d.units[size_t(u)]}, {"parameters", ordered_json::array()}});
  }
  // Over tp ranks each parameter is placed as the model computes it, or
  // replicated with its block (distributed.tp_plan).
  const int64_t tp = mesh.axis_size(Axis::tp);
  const TensorParallelChoice choice =
      tp > 1 ? choose_tensor_parallel(config, d) : TensorParallelChoice{};
  ordered_json parameters = ordered_json::array();
  for (const ModelParameter& p : d.parameters) {
    units[listed_at[size_t(p.unit)]]["parameters"].push_back(p.name);
    const std::string placement =
        tp > 1 ? choice.placements[size_t(&p - d.parameters.data())] : "replicate";
    std::vector<int64_t> local_shape = p.shape;
    if (const auto parsed = parse_tensor_placement(placement, p.shape.size());
        parsed && parsed->sharded()) {
      local_shape[size_t(parsed->dim)] /= tp;
    }
    parameters.push_back({{"name", p.name},
                          {"shape", p.shape},
                          {"unit", d.units[size_t(p.unit)]},
                          {"tp", placement},
                          {"local_shape", std::move(local_shape)}});
  }
  ordered_json checkpointed = ordered_json::array();
  const std::string& mode = config.distributed.activation_checkpointing;
  for (int32_t u = 0; !mode.empty() && u < d.root_unit(); ++u) {
    if (d.is_layer_unit(u))
      checkpointed.push_back({{"module", d.units[size_t(u)]}, {"mode", mode}});
  }
  const int64_t pp = mesh.axis_size(Axis::pp);
  return {{"units", std::move(units)},
          {"parameters", std::move(parameters)},
          {"tensor_parallel", tp > 1 ? choice.rules : ordered_json::array()},
          {"pipeline", pp > 1 ? pipeline_split(config, d, pp, schedule) : ordered_json(nullptr)},
          {"activation_checkpointing", std::move(checkpointed)},
          {"sequence_parallel", tp > 1 && config.distributed.sequence_parallel},
          {"async_tensor_parallel", tp > 1 && config.distributed.enable_async_tensor_parallel},
          {"autocast_dtype", autocast_dtype(config, d)},
          {"context_parallel", context_parallel(config)}};
}

ordered_json sidecar_request(const Config& config, const MeshContext& mesh, const Model& model,
                             const ordered_json& default_model_plan,
                             const PluginLibrary* schedule) {
  const DistributedConfig& d = config.distributed;
  ordered_json model_keys = config.model.architecture;
  model_keys["model_type"] = config.model.model_type;
  ordered_json pipeline = {
      {"stages_per_rank", schedule ? schedule->api().schedule->stages_per_rank : 1},
      {"placement",
       schedule && schedule->api().schedule->placement == MESHRUN_PLACEMENT_V ? "v" : "loop"},
      {"layers_per_stage", d.pipeline.layers_per_stage},
      {"round_virtual_stages_to_pp_multiple", d.pipeline.round_virtual_stages_to_pp_multiple},
      {"module_fqns_per_model_part", d.pipeline.module_fqns_per_model_part}};
  return {{"model", std::move(model_keys)},
          {"description", model.description().json},
          {"default_plan", default_model_plan},
          {"mesh",
           {{"pp", mesh.axis_size(Axis::pp)},
            {"dp_replicate", mesh.axis_size(Axis::dp_replicate)},
            {"dp_shard", mesh.axis_size(Axis::dp_shard)},
            {"cp", mesh.axis_size(Axis::cp)},
            {"tp", mesh.axis_size(Axis::tp)},
            {"ep", mesh.axis_size(Axis::ep)}}},
          {"sequence_parallel", d.sequence_parallel},
          {"activation_checkpointing", d.activation_checkpointing},
          {"pipeline", std::move(pipeline)}};
}

// An input error about the plugins that model.model_type selects.
[[noreturn]] void refuse_model_type(const std::string& what) {
  throw Error(MESHRUN_INVALID_ARGUMENT, "model.model_type: " + what, "model.model_type");
}

// The sidecar's message starts with the dotted config key it concerns;
// without one it is about the sidecar itself.
[[noreturn]] void rethrow_sidecar_error(const PluginLibrary& sidecar, int32_t code,
                                        const std::string& message) {
  const auto colon = message.find(": ");
  const std::string key = colon == std::string::npos ? "" : message.substr(0, colon);
  const bool keyed = key.find(' ') == std::string::npos &&
                     (key.rfind("model.", 0) == 0 || key.rfind("distributed.", 0) == 0 ||
                      key.rfind("data.", 0) == 0 || key.rfind("train.", 0) == 0);
  if (!keyed) refuse_model_type(fmt::format("sidecar {}: {}", sidecar.path(), message));
  throw Error(code, message, key);
}

ordered_json ask_sidecar(const std::shared_ptr<PluginLibrary>& sidecar,
                         const ordered_json& request) {
  const meshrun_sidecar_api& api = *sidecar->api().sidecar;
  if (!MESHRUN_HAS_FIELD(meshrun_sidecar_api, &api, plan) || api.plan == nullptr) {
    refuse_model_type(
        fmt::format("sidecar {} (ABI {}.{}) cannot plan: its table has no `plan` (ABI 1.2); "
                    "remove it from the plugin path to use the default plan",
                    sidecar->path(), sidecar->api().abi_major, sidecar->api().abi_minor));
  }
  const PluginInstance instance(sidecar);
  const std::string text = request.dump();
  char* plan_json = nullptr;
  meshrun_error* error = call_plugin(
      *sidecar, "plan", [&] { return api.plan(instance.handle(), text.c_str(), &plan_json); });
  if (error != nullptr) {
    const int32_t code = error->code;
    const std::string message = error->message != nullptr ? error->message : "";
    meshrun_error_release(error);
    rethrow_sidecar_error(*sidecar, code, message);
  }
  if (plan_json == nullptr) {
    refuse_model_type(
        fmt::format("sidecar {}: plan succeeded but returned no plan", sidecar->path()));
  }
  const std::string answer = plan_json;
  host_services().deallocate(host_services().context, plan_json);
  try {
    return ordered_json::parse(answer);
  } catch (const nlohmann::json::exception& e) {
    refuse_model_type(
        fmt::format("sidecar {}: its plan is not JSON: {}", sidecar->path(), e.what()));
  }
}

// Checks a sidecar's plan against the model it plans: the units are the
// description's, every parameter is placed once with its shape, and a
// pipeline split cuts the module list in order.
class PlanCheck {
 public:
  PlanCheck(const ModelDescription& d, const MeshContext& mesh, std::string sidecar,
            std::string model)
      : d_(d), mesh_(mesh), sidecar_(std::move(sidecar)), model_(std::move(model)) {}

  void check(const ordered_json& plan) const {
    if (!plan.is_object()) fail("the plan is not a JSON object");
    check_units(array(plan, "units"));
    check_parameters(array(plan, "parameters"));
    if (!plan.contains("tensor_parallel") || !plan.at("tensor_parallel").is_array()) {
      fail("\"tensor_parallel\" must be an array");
    }
    if (!plan.contains("activation_checkpointing") ||
        !plan.at("activation_checkpointing").is_array()) {
      fail("\"activation_checkpointing\" must be an array");
    }
    check_pipeline(plan.contains("pipeline") ? plan.at("pipeline") : ordered_json());
  }

  // The settings the config decides for the whole run: a sidecar places
  // parameters and splits stages, it does not change these.
  void keeps_run_settings(const ordered_json& default_plan, const ordered_json& plan) const {
    for (const char* key :
         {"sequence_parallel", "async_tensor_parallel", "autocast_dtype", "context_parallel"}) {
      // Compared as JSON values: a sidecar may reorder an object's keys.
      const nlohmann::json planned = plan.value(key, ordered_json());
      if (planned != nlohmann::json(default_plan.value(key, ordered_json()))) {
        fail(fmt::format("\"{}\" is {}, but the config makes it {}", key,
                         plan.value(key, ordered_json()).dump(), default_plan.at(key).dump()));
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    refuse_model_type(fmt::format("sidecar {} made a plan that does not fit model plugin {}: {}",
                                  sidecar_, model_, what));
  }
  const ordered_json& array(const ordered_json& plan, const char* name) const {
    if (!plan.contains(name) || !plan.at(name).is_array()) {
      fail(fmt::format("the plan has no \"{}\" array", name));
    }
    return plan.at(name);
  }
  static std::string text(const ordered_json& value) {
    return value.is_string() ? value.get<std::string>() : value.dump();
  }

  void check_units(const ordered_json& units) const {
    std::map<std::string, std::set<std::string>> expected;
    for (const std::string& unit : d_.units) expected[unit];
    for (const ModelParameter& p : d_.parameters) expected[d_.units[size_t(p.unit)]].insert(p.name);
    std::set<std::string> seen;
    for (const auto& unit : units) {
      const std::string name = unit.contains("name") ? text(unit.at("name")) : "";
      const auto found = expected.find(name);
      if (found == expected.end() || !seen.insert(name).second) {
        fail(fmt::format("unit '{}' is not a unit of the model, or listed twice", name));
      }
      std::set<std::string> held;
      if (unit.contains("parameters") && unit.at("parameters").is_array()) {
        for (const auto& parameter : unit.at("parameters")) held.insert(text(parameter));
      }
      if (held != found->second) {
        fail(fmt::format("unit '{}' does not hold exactly the model's parameters of that unit",
                         name));
      }
    }
    if (seen.size() != expected.size()) fail("the plan leaves out some of the model's units");
  }

  void check_parameters(const ordered_json& parameters) const {
    std::set<std::string> seen;
    for (const auto& entry : parameters) {
      const std::string name = entry.contains("name") ? text(entry.at("name")) : "";
      const int64_t index = d_.parameter_index(name);
      if (index < 0 || !seen.insert(name).second) {
        fail(fmt::format("parameter '{}' is not a parameter of the model, or listed twice", name));
      }
      if (!entry.contains("shape") ||
          entry.at("shape") != ordered_json(d_.parameters[size_t(index)].shape)) {
        fail(fmt::format("parameter '{}' has shape {}, the model's is {}", name,
                         entry.contains("shape") ? entry.at("shape").dump() : "none",
                         ordered_json(d_.parameters[size_t(index)].shape).dump()));
      }
    }
    if (seen.size() != d_.parameters.size())
      fail("the plan leaves out some of the model's parameters");
  }

  void check_pipeline(const ordered_json& pipeline) const {
    const int64_t pp = mesh_.axis_size(Axis::pp);
    if (pp == 1) {
      if (!pipeline.is_null()) fail("\"pipeline\" must be null without pipeline parallelism");
      return;
    }
    if (!pipeline.is_array() || pipeline.empty()) fail("\"pipeline\" must list the stages");
    size_t next = 0;
    for (size_t s = 0; s < pipeline.size(); ++s) {
      const ordered_json& stage = pipeline[s];
      if (!stage.contains("stage") || stage.at("stage") != ordered_json(s) ||
          !stage.contains("rank") || !stage.at("rank").is_number_integer() ||
          stage.at("rank").get<int64_t>() < 0 || stage.at("rank").get<int64_t>() >= pp ||
          !stage.contains("modules") || !stage.at("modules").is_array() ||
          stage.at("modules").empty()) {
        fail(
            fmt::format("pipeline stage {} needs \"stage\": {}, a \"rank\" in [0, {}) and "
                        "non-empty \"modules\"",
                        s, s, pp));
      }
      for (const auto& module : stage.at("modules")) {
        if (next >= d_.modules.size() || text(module) != d_.modules[next].name) {
          fail(
              fmt::format("pipeline stage {} has module '{}' where the model's next module is "
                          "'{}'",
                          s, text(module), next < d_.modules.size() ? d_.modules[next].name : ""));
        }
        ++next;
      }
    }
    if (next != d_.modules.size())
      fail("the pipeline leaves out module '" + d_.modules[next].name + "'");
  }

  const ModelDescription& d_;
  const MeshContext& mesh_;
  std::string sidecar_, model_;
};

}  // namespace

std::string matmul_dtype(const Config& config, const ModelDescription& d) {
  const DistributedConfig& distributed = config.distributed;
  if (!distributed.autocast_dtype.empty()) return distributed.autocast_dtype;
  const std::string& param_dtype = distributed.mp_policy.param_dtype;
  const auto& supported = d.autocast_dtypes;
  const bool computes_in_param_dtype =
      distributed.strategy == "fsdp2" &&
      std::find(supported.begin(), supported.end(), param_dtype) != supported.end();
  return computes_in_param_dtype ? param_dtype : "float32";
}

ordered_json plan_model(const Config& config, const MeshContext& mesh, const Model& model,
                        const std::shared_ptr<PluginLibrary>& sidecar,
                        const PluginLibrary* schedule) {
  ordered_json plan = default_plan(config, mesh, model.description(), schedule);
  if (!sidecar) return plan;
  ordered_json planned = ask_sidecar(sidecar, sidecar_request(config, mesh, model, plan, schedule));
  const PlanCheck check(model.description(), mesh, sidecar->path(), model.library().path());
  check.check(planned);
  check.keeps_run_settings(plan, planned);
  return planned;
}

}  // namespace meshrun
