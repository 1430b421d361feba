// The Llama model plugin (meshrun/model.h, model_type "llama"): the
// configuration from [model], the description (parameters, units, modules,
// the Hugging Face config.json) and stages of the model over the host's
// hooks (common/host_stage.hpp).
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "common/config_reader.hpp"
#include "common/host_stage.hpp"
#include "llama/model.hpp"
#include "llama/stage.hpp"

namespace {

using meshrun::llama::LlamaConfig;
using meshrun::llama::ParameterView;
using meshrun::models::ModelModules;
using nlohmann::ordered_json;

const char* const kConfigKeys[] = {"vocab_size",
                                   "hidden_size",
                                   "intermediate_size",
                                   "num_hidden_layers",
                                   "num_attention_heads",
                                   "num_key_value_heads",
                                   "max_position_embeddings",
                                   "rms_norm_eps",
                                   "rope_theta",
                                   "tie_word_embeddings",
                                   nullptr};

struct LlamaPlugin {
  using Family = meshrun::llama::Llama;

  static LlamaConfig read_config(const char* config_json) {
    const meshrun::models::ConfigReader reader(config_json);
    LlamaConfig c;
    c.vocab_size = reader.dimension("vocab_size", c.vocab_size);
    c.hidden_size = reader.dimension("hidden_size", c.hidden_size);
    c.intermediate_size = reader.dimension("intermediate_size", c.intermediate_size);
    c.num_hidden_layers =
        reader.integer("num_hidden_layers", c.num_hidden_layers, 1, meshrun::models::kMaxLayers);
    c.num_attention_heads = reader.integer("num_attention_heads", c.num_attention_heads);
    // Hugging Face's default: one key/value head per attention head.
    c.num_key_value_heads = reader.integer("num_key_value_heads", c.num_attention_heads);
    c.max_position_embeddings =
        reader.integer("max_position_embeddings", c.max_position_embeddings);
    c.rms_norm_eps = reader.positive_number("rms_norm_eps", c.rms_norm_eps);
    c.rope_theta = reader.positive_number("rope_theta", c.rope_theta);
    c.tie_word_embeddings = reader.boolean("tie_word_embeddings", c.tie_word_embeddings);
    meshrun::llama::check_config(c);
    return c;
  }

  static ordered_json hf_config(const LlamaConfig& c) {
    return {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.hidden_size},
            {"intermediate_size", c.intermediate_size},
            {"num_hidden_layers", c.num_hidden_layers},
            {"num_attention_heads", c.num_attention_heads},
            {"num_key_value_heads", c.num_key_value_heads},
            {"tie_word_embeddings", c.tie_word_embeddings},
            {"head_dim", c.hidden_size / c.num_attention_heads},
            {"hidden_act", "silu"},
            {"max_position_embeddings", c.max_position_embeddings},
            {"rms_norm_eps", c.rms_norm_eps},
            {"rope_theta", c.rope_theta},
            {"attention_bias", false},
            {"mlp_bias", false}};
  }

  // The embedding, the layers, and the head (final norm and lm_head,
  // inseparable: the loss needs both); a tied lm_head uses the embedding.
  static ModelModules modules(const LlamaConfig& config) {
    const std::string embedding = "model.embed_tokens.weight";
    return {{{"model.embed_tokens", {embedding}, ""}},
            "model.layers.",
            {{"model.norm", {"model.norm.weight"}, "head"},
             {"lm_head", {config.tie_word_embeddings ? embedding : "lm_head.weight"}, "head"}}};
  }

  static std::string describe(const LlamaConfig& config,
                              const std::vector<ParameterView>& parameters) {
    return meshrun::models::describe_model(
        {{"config", hf_config(config)},
         {"vocab_size", config.vocab_size},
         {"max_seq_len", nullptr},
         {"num_layers_key", "num_hidden_layers"},
         {"sequence_parallel", Family::kSequenceParallel},
         {"autocast_dtypes", {"bfloat16"}},
         {"unit_class", "LlamaDecoderLayer"},
         {"context_parallel",
          {{"heads", config.num_attention_heads}, {"kv_heads", config.num_key_value_heads}}},
         {"tp_blocks", meshrun::models::tp_blocks_json(tensor_parallel_blocks(config))}},
        parameters, config.num_hidden_layers, modules(config));
  }
};

const meshrun_model_api kModelApi =
    meshrun::plugin::ModelTable<meshrun::models::HostModel<LlamaPlugin>,
                                meshrun::models::HostStage<LlamaPlugin>>::make("llama",
                                                                               kConfigKeys);

const meshrun_plugin_api kApi = meshrun::models::model_plugin_api(
    "llama", MESHRUN_PLUGIN_VERSION,
    "Llama (LlamaForCausalLM): RMSNorm, rotary attention with grouped key/value heads, "
    "SwiGLU; float32 compute through OpenBLAS; pipeline stages with split backward",
    &kModelApi);

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
