// The hand-written Mixtral (model_type "hand_mixtral"): the Mixtral family
// of mixtral/moe.hpp as a model plugin, the oracle of the shipped mixtral
// plugin, which the model kit composes (tests/kit/test_kit_models.py: equal
// bit for bit). The configuration from [model], the description
// (parameters with their experts, units, modules, the Hugging Face
// config.json) and stages over the host's hooks, experts spread over the ep
// ranks.
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

struct MixtralPlugin {
  using Family = meshrun::mixtral::Mixtral;

  static MixtralConfig read_config(const char* config_json) {
    return meshrun::mixtral::read_config(meshrun::models::ConfigReader(config_json));
  }

  static ordered_json hand_config(const MixtralConfig& config) {
    ordered_json hf = meshrun::mixtral::hf_config(config);
    hf["model_type"] = "hand_mixtral";
    return hf;
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
        {{"config", hand_config(config)},
         {"vocab_size", config.vocab_size},
         {"max_seq_len", nullptr},
         {"num_layers_key", "num_hidden_layers"},
         {"autocast_dtypes", {"bfloat16"}},
         {"unit_class", "MixtralDecoderLayer"},
         {"tensor_parallel", false},
         {"experts", {{"count", config.num_local_experts}, {"top_k", config.num_experts_per_tok}}},
         {"flops", meshrun::models::flops_json(matmul_parameters(config), config.num_hidden_layers,
                                               config.hidden_size)}},
        parameters, config.num_hidden_layers, modules(config));
  }
};

const meshrun_model_api kModelApi = meshrun::plugin::ModelTable<
    meshrun::models::HostModel<MixtralPlugin>,
    meshrun::models::HostStage<MixtralPlugin>>::make("hand_mixtral",
                                                     meshrun::mixtral::config_keys().data());

const meshrun_plugin_api kApi = meshrun::models::model_plugin_api(
    "hand_mixtral", MESHRUN_PLUGIN_VERSION,
    "the hand-written Mixtral family, the mixtral model kit composition's oracle in the tests",
    &kModelApi);

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
