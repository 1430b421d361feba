// qwen2 — a meshrun model plugin composed from the model kit (meshrun/kit.h),
// model_type "qwen2": Hugging Face's Qwen2ForCausalLM.
//
//   x = embed_tokens[tokens]
//   per layer: h   = x + o_proj(attention(rope(q/k/v_proj(rmsnorm(x)) + bias)))
//              out = h + down_proj(silu(gate_proj(n)) * up_proj(n)), n = rmsnorm(h)
//   logits = lm_head(rmsnorm(x_L)); mean cross-entropy
//
// Qwen2 is Llama with biases on q, k and v: the layer below is the whole
// difference. Everything else — backward, tensor/context/pipeline
// parallelism, checkpointing, bfloat16 matmuls, the Hugging Face export —
// comes from the kit.
#include <cstdint>

#include "meshrun/kit.h"

namespace {

// The decoder layer, in Hugging Face's module names.
const meshrun_kit_op kLayer[] = {
    {MESHRUN_KIT_RMSNORM, 0, "input_layernorm", "x", nullptr, "n1"},
    {MESHRUN_KIT_ATTENTION, MESHRUN_KIT_BIAS_IN, "self_attn", "n1", nullptr, "a"},
    {MESHRUN_KIT_ADD, 0, nullptr, "x", "a", "h"},
    {MESHRUN_KIT_RMSNORM, 0, "post_attention_layernorm", "h", nullptr, "n2"},
    {MESHRUN_KIT_SWIGLU_MLP, 0, "mlp", "n2", nullptr, "m"},
    {MESHRUN_KIT_ADD, 0, nullptr, "h", "m", "out"},
};

// Qwen2Config's defaults for what [model] may leave unset; the sizes have
// small defaults of our own so that a config trains on a CPU.
constexpr double kRmsNormEps = 1e-6;
constexpr double kRopeTheta = 1e6;
constexpr int64_t kMaxPositions = 32768;
constexpr int64_t kLargest = int64_t(1) << 30;
constexpr const char* kConfigDefaults =
    R"({"hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "use_sliding_window": false,
        "attention_dropout": 0.0})";

const char* const kConfigKeys[] = {"vocab_size",
                                   "hidden_size",
                                   "intermediate_size",
                                   "num_hidden_layers",
                                   "num_attention_heads",
                                   "num_key_value_heads",
                                   "rms_norm_eps",
                                   "rope_theta",
                                   "max_position_embeddings",
                                   "tie_word_embeddings",
                                   nullptr};

// Calls a kit reader; returns its error from the enclosing function.
#define READ(call)                                   \
  do {                                               \
    if (meshrun_error* error = (call)) return error; \
  } while (0)

meshrun_error* compose(const meshrun_kit_config* config, meshrun_kit_model_spec* spec) {
  int64_t max_positions = 0;
  int32_t tied = 0;
  READ(meshrun_kit_config_integer(config, "vocab_size", 256, 1, kLargest, &spec->vocab_size));
  READ(meshrun_kit_config_integer(config, "hidden_size", 64, 1, kLargest, &spec->hidden_size));
  READ(meshrun_kit_config_integer(config, "intermediate_size", 128, 1, kLargest,
                                  &spec->intermediate_size));
  READ(meshrun_kit_config_integer(config, "num_hidden_layers", 2, 1, 2048,
                                  &spec->num_hidden_layers));
  READ(meshrun_kit_config_integer(config, "num_attention_heads", 4, 1, kLargest,
                                  &spec->num_attention_heads));
  // Hugging Face's default: one key/value head per attention head.
  READ(meshrun_kit_config_integer(config, "num_key_value_heads", spec->num_attention_heads, 1,
                                  kLargest, &spec->num_key_value_heads));
  READ(meshrun_kit_config_positive(config, "rms_norm_eps", kRmsNormEps, &spec->norm_eps));
  READ(meshrun_kit_config_positive(config, "rope_theta", kRopeTheta, &spec->rope_theta));
  READ(meshrun_kit_config_integer(config, "max_position_embeddings", kMaxPositions, 1, kLargest,
                                  &max_positions));
  READ(meshrun_kit_config_boolean(config, "tie_word_embeddings", 0, &tied));
  spec->tie_word_embeddings = tied;
  spec->num_ops = sizeof kLayer / sizeof kLayer[0];
  spec->ops = kLayer;
  spec->architecture = "Qwen2ForCausalLM";
  spec->layer_class = "Qwen2DecoderLayer";
  spec->config_json = kConfigDefaults;
  return nullptr;
}

const meshrun_kit_plugin qwen2 = {sizeof(meshrun_kit_plugin),
                                  "qwen2",
                                  "1.0.0",
                                  "Qwen2 (Qwen2ForCausalLM), composed from the meshrun model kit",
                                  kConfigKeys,
                                  compose};

}  // namespace

MESHRUN_KIT_DEFINE_PLUGIN(qwen2)
