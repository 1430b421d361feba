// The Llama sidecar ("ModelParallelizer"): refines the default plan of
// model_type "llama" (docs/plan.md) with AutoModel's module-level
// tensor-parallel plan for Llama, after checking that the heads, the
// intermediate size and the vocabulary divide over tp. The placement of
// every parameter is the model's description's; units, the pipeline split
// and the checkpoint set stay the default plan's.
#include <nlohmann/json.hpp>

#include <cstring>
#include <stdexcept>
#include <string>

#include "llama/model.hpp"
#include "meshrun/plugin.hpp"

namespace {

using meshrun::plugin::Error;
using nlohmann::json;

// AutoModel's _validate_tp_mesh (heads and key/value heads divide by tp),
// and the intermediate size and vocabulary the parallel layers split.
void validate(const json& config, int64_t tp) {
  meshrun::llama::LlamaConfig c;
  c.num_attention_heads = config.at("num_attention_heads").get<int64_t>();
  c.num_key_value_heads = config.at("num_key_value_heads").get<int64_t>();
  c.intermediate_size = config.at("intermediate_size").get<int64_t>();
  c.vocab_size = config.at("vocab_size").get<int64_t>();
  try {
    meshrun::llama::check_tensor_parallel(c, tp);
  } catch (const std::invalid_argument& e) {
    throw Error(MESHRUN_INVALID_ARGUMENT, e.what());
  }
}

// AutoModel's tensor-parallel plan for Llama, with sequence parallelism
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

json plan_of(const json& request) {
  const int64_t tp = request.at("mesh").at("tp").get<int64_t>();
  validate(request.at("description").at("config"), tp);
  json plan = request.at("default_plan");
  if (tp == 1) return plan;
  plan["tensor_parallel"] = tensor_parallel_plan(request.value("sequence_parallel", false));
  return plan;
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
    "Llama sidecar: AutoModel's tensor-parallel plan for model_type llama (column-wise q, k, v, "
    "gate, up; row-wise o, down; vocabulary-parallel embedding and lm_head), heads checked "
    "against tp",
    &meshrun::plugin::create_instance<meshrun::plugin::HostServicesOnly>,
    &meshrun::plugin::destroy_instance<meshrun::plugin::HostServicesOnly>,
    nullptr,
    nullptr,
    &kSidecarApi,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
