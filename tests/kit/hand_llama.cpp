// hand_llama — the hand-written Llama (models/llama's family, model_type
// "hand_llama"), as the shipped llama plugin was before it became a model
// kit composition: the kit's oracle. The kit tests train both and compare
// them bit for bit; the kit benchmark times them against each other.
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

struct LlamaPlugin {
  using Family = meshrun::llama::Llama;

  static LlamaConfig read_config(const char* config_json) {
    return meshrun::llama::read_decoder_config(meshrun::models::ConfigReader(config_json), {});
  }

  static ordered_json hf_config(const LlamaConfig& c) {
    return {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "hand_llama"},
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

  static ModelModules modules(const LlamaConfig& config) {
    return meshrun::llama::decoder_modules(config.tie_word_embeddings);
  }

  // Weights a token meets in matmuls: per layer q, k, v, o and the SwiGLU's
  // gate, up and down; then the lm_head (the embedding itself is a lookup).
  static int64_t matmul_parameters(const LlamaConfig& c) {
    const int64_t head_dim = c.hidden_size / c.num_attention_heads;
    const int64_t attention =
        2 * c.hidden_size * (c.hidden_size + c.num_key_value_heads * head_dim);
    const int64_t mlp = 3 * c.hidden_size * c.intermediate_size;
    return c.num_hidden_layers * (attention + mlp) + c.vocab_size * c.hidden_size;
  }

  // What decoder.hpp's LayerActivations and HeadActivations hold per token:
  // norm1, rstd1, h, norm2, rstd2 whole; qkv, the heads' log-sum-exps, the
  // attention output, gate_up and mlp split over tp; selective
  // checkpointing drops the norms and mlp (Llama::elementwise). A bfloat16
  // run keeps the 1/rms, log-sum-exps and logits in float32
  // (Llama::low_precision).
  static ordered_json activations(const LlamaConfig& c) {
    const int64_t h = c.hidden_size, heads = c.num_attention_heads;
    const int64_t head_dim = h / heads;
    const int64_t qkv = (heads + 2 * c.num_key_value_heads) * head_dim;
    return meshrun::models::activations_json(
        {3 * h + 2, qkv + heads + heads * head_dim + 3 * c.intermediate_size, 2 * h + 2,
         c.intermediate_size, h, h + 1, c.vocab_size},
        {2, heads, 2, 0, 1, c.vocab_size});
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
         {"tp_blocks", meshrun::models::tp_blocks_json(tensor_parallel_blocks(config))},
         {"flops", meshrun::models::flops_json(matmul_parameters(config), config.num_hidden_layers,
                                               config.hidden_size)},
         {"activations", activations(config)}},
        parameters, config.num_hidden_layers, modules(config));
  }
};

const meshrun_model_api kModelApi = meshrun::plugin::ModelTable<
    meshrun::models::HostModel<LlamaPlugin>,
    meshrun::models::HostStage<LlamaPlugin>>::make("hand_llama",
                                                   meshrun::llama::kDecoderConfigKeys);

const meshrun_plugin_api kApi = meshrun::models::model_plugin_api(
    "hand_llama", MESHRUN_PLUGIN_VERSION,
    "Llama (LlamaForCausalLM): RMSNorm, rotary attention with grouped key/value heads, "
    "SwiGLU; GEMMs through oneDNN in float32 or bfloat16; pipeline stages with split backward",
    &kModelApi);

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
