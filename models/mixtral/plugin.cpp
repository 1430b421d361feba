// The Mixtral model plugin (meshrun/model.h, model_type "mixtral"): the
// configuration from [model], the description (parameters with their
// experts, units, modules, the Hugging Face config.json) and stages over
// the host's hooks, experts spread over the ep ranks.
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "common/config_reader.hpp"
#include "common/host_stage.hpp"
#include "mixtral/moe.hpp"

namespace {

using meshrun::mixtral::MixtralConfig;
using meshrun::mixtral::ParameterView;
using meshrun::models::ModelModules;
using nlohmann::ordered_json;

// Llama's decoder keys, then the routing's; NULL-terminated.
const std::vector<const char*> kConfigKeys = [] {
  std::vector<const char*> keys;
  for (const char* const* key = meshrun::llama::kDecoderConfigKeys; *key != nullptr; ++key) {
    keys.push_back(*key);
  }
  keys.insert(keys.end(),
              {"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", nullptr});
  return keys;
}();

struct MixtralPlugin {
  using Family = meshrun::mixtral::Mixtral;

  // meshrun's tiny defaults for the sizes (as its Llama's), Mixtral's for
  // the routing.
  static MixtralConfig read_config(const char* config_json) {
    const meshrun::models::ConfigReader reader(config_json);
    meshrun::llama::LlamaConfig decoder;
    decoder.intermediate_size = 512;
    decoder.rope_theta = 1e6;
    MixtralConfig c;
    static_cast<meshrun::llama::LlamaConfig&>(c) =
        meshrun::llama::read_decoder_config(reader, decoder);
    c.num_local_experts = reader.integer("num_local_experts", c.num_local_experts, 1, 4096);
    c.num_experts_per_tok = reader.integer("num_experts_per_tok", c.num_experts_per_tok);
    c.router_aux_loss_coef =
        reader.non_negative_number("router_aux_loss_coef", c.router_aux_loss_coef);
    meshrun::mixtral::check_config(c);
    return c;
  }

  static ordered_json hf_config(const MixtralConfig& c) {
    const meshrun::llama::LlamaConfig& d = c;
    return {{"architectures", {"MixtralForCausalLM"}},
            {"model_type", "mixtral"},
            {"vocab_size", d.vocab_size},
            {"hidden_size", d.hidden_size},
            {"intermediate_size", d.intermediate_size},
            {"num_hidden_layers", d.num_hidden_layers},
            {"num_attention_heads", d.num_attention_heads},
            {"num_key_value_heads", d.num_key_value_heads},
            {"head_dim", d.hidden_size / d.num_attention_heads},
            {"hidden_act", "silu"},
            {"max_position_embeddings", d.max_position_embeddings},
            {"rms_norm_eps", d.rms_norm_eps},
            {"rope_theta", d.rope_theta},
            {"tie_word_embeddings", d.tie_word_embeddings},
            {"num_local_experts", c.num_local_experts},
            {"num_experts_per_tok", c.num_experts_per_tok},
            {"router_aux_loss_coef", c.router_aux_loss_coef},
            {"output_router_logits", false},
            {"router_jitter_noise", 0.0},
            {"sliding_window", nullptr}};
  }

  static ModelModules modules(const MixtralConfig& config) {
    return meshrun::llama::decoder_modules(config.tie_word_embeddings);
  }

  // Weights a token meets in matmuls: per layer q, k, v, o, the router and
  // its top_k experts' gate, up and down; then the lm_head.
  static int64_t matmul_parameters(const MixtralConfig& c) {
    const int64_t head_dim = c.hidden_size / c.num_attention_heads;
    const int64_t attention =
        2 * c.hidden_size * (c.hidden_size + c.num_key_value_heads * head_dim);
    const int64_t experts = c.num_experts_per_tok * 3 * c.hidden_size * c.intermediate_size;
    const int64_t router = c.hidden_size * c.num_local_experts;
    return c.num_hidden_layers * (attention + router + experts) + c.vocab_size * c.hidden_size;
  }

  static std::string describe(const MixtralConfig& config,
                              const std::vector<ParameterView>& parameters) {
    return meshrun::models::describe_model(
        {{"config", hf_config(config)},
         {"vocab_size", config.vocab_size},
         {"max_seq_len", nullptr},
         {"num_layers_key", "num_hidden_layers"},
         {"autocast_dtypes", {"bfloat16"}},
         {"unit_class", "MixtralDecoderLayer"},
         {"experts", {{"count", config.num_local_experts}, {"top_k", config.num_experts_per_tok}}},
         {"flops", meshrun::models::flops_json(matmul_parameters(config), config.num_hidden_layers,
                                               config.hidden_size)}},
        parameters, config.num_hidden_layers, modules(config));
  }
};

const meshrun_model_api kModelApi =
    meshrun::plugin::ModelTable<meshrun::models::HostModel<MixtralPlugin>,
                                meshrun::models::HostStage<MixtralPlugin>>::make("mixtral",
                                                                                 kConfigKeys
                                                                                     .data());

const meshrun_plugin_api kApi = meshrun::models::model_plugin_api(
    "mixtral", MESHRUN_PLUGIN_VERSION,
    "Mixtral (MixtralForCausalLM): Llama's attention with a sparse mixture of SwiGLU experts, "
    "top-k routing and the load-balancing loss; experts spread over the ep ranks (all-to-all "
    "dispatch and combine); pipeline stages with split backward",
    &kModelApi);

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
