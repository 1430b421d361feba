// The Llama sidecar ("ModelParallelizer"): refines the default plan of
// model_type "llama" (docs/plan.md) with how AutoModel's Llama plan treats
// the activations of each module's tensor-parallel style, after checking
// that what the parallel blocks split (heads, intermediate size,
// vocabulary) divides over tp. Every parameter's placement is the default
// plan's (the description's, under distributed.tp_plan); units, the
// pipeline split and the checkpoint set stay the default plan's too.
#include <nlohmann/json.hpp>

#include <cstring>
#include <stdexcept>
#include <string>

#include "llama/model.hpp"
#include "meshrun/plugin.hpp"

namespace {

using meshrun::plugin::Error;
using nlohmann::json;

// The blocks the default plan computes over tp (its "parameters"' "tp",
// which distributed.tp_plan may have replicated).
meshrun::models::ParallelBlocks planned_blocks(const json& plan, bool tied) {
  using meshrun::models::Block;
  meshrun::models::ParallelBlocks blocks;
  for (Block block : {Block::attention, Block::mlp, Block::embedding, Block::head}) {
    blocks.set(block, false);
  }
  for (const auto& parameter : plan.at("parameters")) {
    if (parameter.value("tp", std::string("replicate")) == "replicate") continue;
    const auto block =
        meshrun::llama::tensor_parallel_block(parameter.at("name").get<std::string>());
    if (block) blocks.set(*block, true);
  }
  if (tied) blocks.set(Block::head, blocks[Block::embedding]);
  return blocks;
}

// AutoModel's _validate_tp_mesh (heads and key/value heads divide by tp),
// and the intermediate size and vocabulary the parallel blocks split.
void validate(const json& config, int64_t tp, const meshrun::models::ParallelBlocks& blocks) {
  meshrun::llama::LlamaConfig c;
  c.num_attention_heads = config.at("num_attention_heads").get<int64_t>();
  c.num_key_value_heads = config.at("num_key_value_heads").get<int64_t>();
  c.intermediate_size = config.at("intermediate_size").get<int64_t>();
  c.vocab_size = config.at("vocab_size").get<int64_t>();
  try {
    meshrun::llama::check_tensor_parallel(c, tp, blocks);
  } catch (const std::invalid_argument& e) {
    throw Error(MESHRUN_INVALID_ARGUMENT, e.what());
  }
}

// How AutoModel's Llama plan treats activations under each module style of
// the default plan's rules; sequence parallelism shards the norms' and the
// row-wise outputs' on the sequence.
std::string activations(const std::string& module, const std::string& style,
                        bool sequence_parallel) {
  if (style == "colwise") {
    return module == "lm_head" ? "output sharded on vocab" : "output sharded on the last dim";
  }
  if (style == "rowwise" && module == "model.embed_tokens") {
    return sequence_parallel ? "input replicated, output sharded on sequence"
                             : "input replicated, output replicated";
  }
  if (style == "rowwise") {
    return sequence_parallel ? "output sharded on sequence" : "output replicated";
  }
  return sequence_parallel ? "input gathered from the sequence, computed whole on every rank"
                           : "computed whole on every rank";
}

json tensor_parallel_plan(const json& rules, bool sequence_parallel) {
  json plan = json::array();
  for (const auto& rule : rules) {
    const std::string module = rule.at("module").get<std::string>();
    const std::string style = rule.at("style").get<std::string>();
    plan.push_back({{"module", module},
                    {"style", style},
                    {"activations", activations(module, style, sequence_parallel)}});
  }
  if (sequence_parallel) {
    for (const char* m : {"model.layers.*.input_layernorm",
                          "model.layers.*.post_attention_layernorm", "model.norm"}) {
      plan.push_back({{"module", m},
                      {"style", "sequence_parallel"},
                      {"activations", "input and output sharded on sequence"}});
    }
  }
  return plan;
}

json plan_of(const json& request) {
  const int64_t tp = request.at("mesh").at("tp").get<int64_t>();
  json plan = request.at("default_plan");
  const json& config = request.at("description").at("config");
  validate(config, tp, planned_blocks(plan, config.value("tie_word_embeddings", false)));
  if (tp == 1) return plan;
  plan["tensor_parallel"] =
      tensor_parallel_plan(plan.at("tensor_parallel"), request.value("sequence_parallel", false));
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
