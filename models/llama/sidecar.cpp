// The Llama sidecar ("ModelParallelizer"): the plan for Hugging Face
// model_type "llama" as data (docs/plan.md): sharding units, the
// tensor-parallel placement of every parameter (ANCHORS.md's Llama plan), the
// pipeline split, and the activation-checkpoint set. Validates the model
// against the mesh with errors that begin with the config key.
#include <nlohmann/json.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "meshrun/plugin.hpp"

namespace {

using meshrun::plugin::Error;
using nlohmann::json;

struct Model {
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads;
  bool tied;
};

struct Mesh {
  int64_t pp, tp;
};

[[noreturn]] void reject(const std::string& key, const std::string& reason) {
  throw Error(MESHRUN_INVALID_ARGUMENT, key + ": " + reason);
}

Model read_model(const json& model) {
  return {model.at("vocab_size"),          model.at("hidden_size"),
          model.at("intermediate_size"),   model.at("num_hidden_layers"),
          model.at("num_attention_heads"), model.at("num_key_value_heads"),
          model.at("tie_word_embeddings")};
}

// ANCHORS.md: heads and kv heads divide by tp; no tied embeddings with pp.
void validate(const Model& model, const Mesh& mesh) {
  if (model.heads % mesh.tp != 0) {
    reject("model.num_attention_heads",
           std::to_string(model.heads) +
               " heads are not divisible by distributed.tp_size = " + std::to_string(mesh.tp));
  }
  if (model.kv_heads % mesh.tp != 0) {
    reject("model.num_key_value_heads",
           std::to_string(model.kv_heads) +
               " key/value heads are not divisible by distributed.tp_size = " +
               std::to_string(mesh.tp));
  }
  if (model.tied && mesh.pp > 1) {
    reject("model.tie_word_embeddings",
           "tied embeddings cannot be split over pipeline stages (distributed.pp_size = " +
               std::to_string(mesh.pp) + ")");
  }
}

// One parameter: HF name and shape, its unit, and how tp places it.
struct Parameter {
  std::string name;
  std::vector<int64_t> shape;
  std::string unit;
  int shard_dim;  // -1: replicated over tp
};

std::vector<Parameter> parameters_of(const Model& m) {
  const int64_t head_dim = m.hidden / m.heads;
  std::vector<Parameter> list = {{"model.embed_tokens.weight", {m.vocab, m.hidden}, "root", 0}};
  for (int64_t layer = 0; layer < m.layers; ++layer) {
    const std::string unit = "model.layers." + std::to_string(layer);
    const auto add = [&](const std::string& leaf, std::vector<int64_t> shape, int dim) {
      list.push_back({unit + "." + leaf + ".weight", std::move(shape), unit, dim});
    };
    add("input_layernorm", {m.hidden}, -1);
    add("self_attn.q_proj", {m.heads * head_dim, m.hidden}, 0);
    add("self_attn.k_proj", {m.kv_heads * head_dim, m.hidden}, 0);
    add("self_attn.v_proj", {m.kv_heads * head_dim, m.hidden}, 0);
    add("self_attn.o_proj", {m.hidden, m.heads * head_dim}, 1);
    add("post_attention_layernorm", {m.hidden}, -1);
    add("mlp.gate_proj", {m.intermediate, m.hidden}, 0);
    add("mlp.up_proj", {m.intermediate, m.hidden}, 0);
    add("mlp.down_proj", {m.hidden, m.intermediate}, 1);
  }
  list.push_back({"model.norm.weight", {m.hidden}, "root", -1});
  if (!m.tied) list.push_back({"lm_head.weight", {m.vocab, m.hidden}, "root", 0});
  return list;
}

// ANCHORS.md's tensor-parallel plan for Llama, with sequence parallelism
// changing how norms and row-wise outputs treat activations.
json tensor_parallel_plan(bool sequence_parallel) {
  json plan = json::array();
  const auto style = [&](const char* module, const char* kind, const char* detail) {
    plan.push_back({{"module", module}, {"style", kind}, {"activations", detail}});
  };
  style("model.embed_tokens", "rowwise",
        sequence_parallel ? "input replicated, output sharded on sequence"
                          : "input replicated, output replicated");
  for (const char* m : {"model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj",
                        "model.layers.*.self_attn.v_proj", "model.layers.*.mlp.gate_proj",
                        "model.layers.*.mlp.up_proj"}) {
    style(m, "colwise", "output sharded on the last dim");
  }
  for (const char* m : {"model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj"}) {
    style(m, "rowwise", sequence_parallel ? "output sharded on sequence" : "output replicated");
  }
  if (sequence_parallel) {
    for (const char* m : {"model.layers.*.input_layernorm",
                          "model.layers.*.post_attention_layernorm", "model.norm"}) {
      style(m, "sequence_parallel", "input and output sharded on sequence");
    }
  }
  style("lm_head", "colwise", "output sharded on vocab");
  return plan;
}

// Stage count per ANCHORS.md: one per rank (times the schedule's stages per
// rank) unless layers_per_stage says, rounded to a multiple of pp as asked.
int64_t stage_count(const Model& model, const Mesh& mesh, const json& pipeline) {
  const int64_t per_stage = pipeline.value("layers_per_stage", int64_t{0});
  if (per_stage <= 0) return mesh.pp * pipeline.value("stages_per_rank", int64_t{1});
  int64_t stages = (model.layers + per_stage - 1) / per_stage;
  if (stages % mesh.pp == 0) return stages;
  const std::string round = pipeline.value("round_virtual_stages_to_pp_multiple", "");
  if (round == "up") return (stages / mesh.pp + 1) * mesh.pp;
  if (round == "down" && stages >= mesh.pp) return stages / mesh.pp * mesh.pp;
  reject("distributed.pipeline.layers_per_stage",
         std::to_string(per_stage) + " layers per stage give " + std::to_string(stages) +
             " stages, not a multiple of distributed.pp_size = " + std::to_string(mesh.pp) +
             "; set round_virtual_stages_to_pp_multiple = \"up\" or \"down\"");
}

// The modules of each stage: layers split evenly over the stages, the
// remainder to the first stages, the embedding on the first and the final
// norm and lm_head on the last.
json even_parts(const Model& model, int64_t stages) {
  if (stages > model.layers) {
    reject("model.num_hidden_layers", std::to_string(model.layers) + " layers cannot fill " +
                                          std::to_string(stages) + " pipeline stages");
  }
  json parts = json::array();
  int64_t first = 0;
  for (int64_t s = 0; s < stages; ++s) {
    const int64_t count = model.layers / stages + (s < model.layers % stages ? 1 : 0);
    json modules = json::array();
    if (s == 0) modules.push_back("model.embed_tokens");
    for (int64_t l = first; l < first + count; ++l)
      modules.push_back("model.layers." + std::to_string(l));
    if (s == stages - 1) modules.insert(modules.end(), {"model.norm", "lm_head"});
    parts.push_back(std::move(modules));
    first += count;
  }
  return parts;
}

// module_fqns_per_model_part as given: every module of the model once, in
// model order, no part empty, the final norm with lm_head (the loss needs
// both), and as many parts as the placement gives the ranks.
json explicit_parts(const Model& model, const Mesh& mesh, const json& parts) {
  const std::string key = "distributed.pipeline.module_fqns_per_model_part";
  std::vector<std::string> expected = {"model.embed_tokens"};
  for (int64_t l = 0; l < model.layers; ++l)
    expected.push_back("model.layers." + std::to_string(l));
  expected.insert(expected.end(), {"model.norm", "lm_head"});
  size_t next = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    if (parts[p].empty()) reject(key, "part " + std::to_string(p) + " holds no module");
    for (const auto& module : parts[p]) {
      const auto name = module.get<std::string>();
      if (next >= expected.size() || name != expected[next]) {
        reject(key, "part " + std::to_string(p) + " has '" + name + "' where the model's next " +
                        "module is " +
                        (next < expected.size() ? "'" + expected[next] + "'" : "none") +
                        " (every module once, in model order: model.embed_tokens, "
                        "model.layers.0.." +
                        std::to_string(model.layers - 1) + ", model.norm, lm_head)");
      }
      if (name == "lm_head" && parts[p].front() == "lm_head") {
        reject(key,
               "model.norm and lm_head must be in one part (the last stage computes the "
               "loss from both)");
      }
      ++next;
    }
  }
  if (next != expected.size()) reject(key, "'" + expected[next] + "' is in no part");
  if (int64_t(parts.size()) % mesh.pp != 0) {
    reject(key,
           std::to_string(parts.size()) +
               " parts are not a multiple of distributed.pp_size = " + std::to_string(mesh.pp));
  }
  return parts;
}

// Stage s runs on rank s mod pp, or for V schedules on ranks r and 2pp-1-r.
json pipeline_split(const Model& model, const Mesh& mesh, const json& pipeline) {
  const json fqns = pipeline.value("module_fqns_per_model_part", json::array());
  const json parts = fqns.empty() ? even_parts(model, stage_count(model, mesh, pipeline))
                                  : explicit_parts(model, mesh, fqns);
  const bool v_shape = pipeline.value("placement", "loop") == "v";
  json split = json::array();
  for (int64_t s = 0; s < int64_t(parts.size()); ++s) {
    const int64_t rank = v_shape && s >= mesh.pp ? 2 * mesh.pp - 1 - s : s % mesh.pp;
    split.push_back({{"stage", s}, {"rank", rank}, {"modules", parts[size_t(s)]}});
  }
  return split;
}

json local_shape(const Parameter& p, int64_t tp) {
  std::vector<int64_t> shape = p.shape;
  if (p.shard_dim >= 0) shape[p.shard_dim] = (shape[p.shard_dim] + tp - 1) / tp;
  return shape;
}

json plan_of(const json& request) {
  const Model model = read_model(request.at("model"));
  const json& mesh_json = request.at("mesh");
  const Mesh mesh{mesh_json.at("pp"), mesh_json.at("tp")};
  validate(model, mesh);
  const auto params = parameters_of(model);

  json units = json::array({{{"name", "root"}, {"parameters", json::array()}}});
  json parameters = json::array();
  for (const auto& p : params) {
    if (p.unit != units.back()["name"] && p.unit != "root") {
      units.push_back({{"name", p.unit}, {"parameters", json::array()}});
    }
    (p.unit == "root" ? units.front() : units.back())["parameters"].push_back(p.name);
    parameters.push_back(
        {{"name", p.name},
         {"shape", p.shape},
         {"unit", p.unit},
         {"tp", p.shard_dim < 0 ? "replicate" : "shard(" + std::to_string(p.shard_dim) + ")"},
         {"local_shape", local_shape(p, mesh.tp)}});
  }
  const std::string checkpointing = request.value("activation_checkpointing", "");
  json checkpointed = json::array();
  if (!checkpointing.empty()) {
    for (int64_t l = 0; l < model.layers; ++l) {
      checkpointed.push_back(
          {{"module", "model.layers." + std::to_string(l)}, {"mode", checkpointing}});
    }
  }
  return {{"units", std::move(units)},
          {"parameters", std::move(parameters)},
          {"tensor_parallel", mesh.tp > 1
                                  ? tensor_parallel_plan(request.value("sequence_parallel", false))
                                  : json::array()},
          {"pipeline",
           mesh.pp > 1 ? pipeline_split(model, mesh, request.at("pipeline")) : json(nullptr)},
          {"activation_checkpointing", std::move(checkpointed)}};
}

meshrun_error* plan(meshrun_plugin_instance* instance, const char* request_json, char** out) {
  return meshrun::plugin::guard([&] {
    if (instance == nullptr || request_json == nullptr || out == nullptr) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  "plan: instance, request_json and out must not be NULL");
    }
    const auto& host = reinterpret_cast<meshrun::plugin::HostServicesOnly*>(instance)->host();
    json request;
    try {
      request = json::parse(request_json);
    } catch (const json::exception& e) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  std::string("plan: the request is not JSON: ") + e.what());
    }
    std::string text;
    try {
      text = plan_of(request).dump();
    } catch (const json::exception& e) {
      throw Error(MESHRUN_INVALID_ARGUMENT, std::string("plan: malformed request: ") + e.what());
    }
    auto* copy = static_cast<char*>(host.allocate(host.context, text.size() + 1, 1));
    if (copy == nullptr) throw Error(MESHRUN_INTERNAL, "plan: out of memory");
    std::memcpy(copy, text.c_str(), text.size() + 1);
    *out = copy;
  });
}

const meshrun_sidecar_api kSidecarApi = [] {
  meshrun_sidecar_api api{};
  api.struct_size = MESHRUN_SIDECAR_API_SIZE_1_2;
  api.model_type = "llama";
  api.plan = &plan;
  return api;
}();

const meshrun_plugin_api kApi = {
    sizeof(meshrun_plugin_api),
    MESHRUN_ABI_VERSION_MAJOR,
    MESHRUN_ABI_VERSION_MINOR,
    MESHRUN_PLUGIN_KIND_SIDECAR,
    "llama",
    MESHRUN_PLUGIN_VERSION,
    "Llama sidecar: plans sharding units (one per decoder layer, the root holds embed_tokens, "
    "norm and lm_head), the tensor-parallel placement of every parameter, the pipeline split "
    "and the activation-checkpoint set for model_type llama",
    &meshrun::plugin::create_instance<meshrun::plugin::HostServicesOnly>,
    &meshrun::plugin::destroy_instance<meshrun::plugin::HostServicesOnly>,
    nullptr,
    nullptr,
    &kSidecarApi,
    nullptr,
    nullptr,
};

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
