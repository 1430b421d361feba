/*
 * kit_llama — the shipped Llama (models/llama, model_type "llama") composed
 * from the model kit instead of written by hand: the same [model] keys,
 * defaults, parameter names, order and initialization, so the two train
 * alike. The kit tests compare them step by step and the kit benchmark
 * times them against each other.
 */
#include <stddef.h>
#include <stdint.h>

#include "meshrun/kit.h"

static const meshrun_kit_op layer[] = {
    {MESHRUN_KIT_RMSNORM, 0, "input_layernorm", "x", NULL, "n1"},
    {MESHRUN_KIT_ATTENTION, 0, "self_attn", "n1", NULL, "a"},
    {MESHRUN_KIT_ADD, 0, NULL, "x", "a", "h"},
    {MESHRUN_KIT_RMSNORM, 0, "post_attention_layernorm", "h", NULL, "n2"},
    {MESHRUN_KIT_SWIGLU_MLP, 0, "mlp", "n2", NULL, "m"},
    {MESHRUN_KIT_ADD, 0, NULL, "h", "m", "out"},
};

static const char* const config_keys[] = {"vocab_size",
                                          "hidden_size",
                                          "intermediate_size",
                                          "num_hidden_layers",
                                          "num_attention_heads",
                                          "num_key_value_heads",
                                          "max_position_embeddings",
                                          "rms_norm_eps",
                                          "rope_theta",
                                          "tie_word_embeddings",
                                          NULL};

#define LARGEST ((int64_t)1 << 40)
#define READ(call)                     \
  do {                                 \
    meshrun_error* error_ = (call);    \
    if (error_ != NULL) return error_; \
  } while (0)

/* models/llama's defaults (LlamaConfig). */
static meshrun_error* compose(const meshrun_kit_config* config, meshrun_kit_model_spec* spec) {
  int64_t max_positions = 0;
  int32_t tied = 0;
  READ(meshrun_kit_config_integer(config, "vocab_size", 256, 1, LARGEST, &spec->vocab_size));
  READ(meshrun_kit_config_integer(config, "hidden_size", 256, 1, LARGEST, &spec->hidden_size));
  READ(meshrun_kit_config_integer(config, "intermediate_size", 768, 1, LARGEST,
                                  &spec->intermediate_size));
  READ(meshrun_kit_config_integer(config, "num_hidden_layers", 4, 1, 2048,
                                  &spec->num_hidden_layers));
  READ(meshrun_kit_config_integer(config, "num_attention_heads", 8, 1, LARGEST,
                                  &spec->num_attention_heads));
  READ(meshrun_kit_config_integer(config, "num_key_value_heads", spec->num_attention_heads, 1,
                                  LARGEST, &spec->num_key_value_heads));
  READ(meshrun_kit_config_integer(config, "max_position_embeddings", 2048, 1, LARGEST,
                                  &max_positions));
  READ(meshrun_kit_config_positive(config, "rms_norm_eps", 1e-5, &spec->norm_eps));
  READ(meshrun_kit_config_positive(config, "rope_theta", 10000.0, &spec->rope_theta));
  READ(meshrun_kit_config_boolean(config, "tie_word_embeddings", 0, &tied));
  spec->tie_word_embeddings = tied;
  spec->num_ops = sizeof layer / sizeof layer[0];
  spec->ops = layer;
  spec->architecture = "LlamaForCausalLM";
  spec->layer_class = "LlamaDecoderLayer";
  spec->config_json =
      "{\"hidden_act\": \"silu\", \"max_position_embeddings\": 2048, \"rms_norm_eps\": 1e-05,"
      " \"rope_theta\": 10000.0, \"attention_bias\": false, \"mlp_bias\": false}";
  return NULL;
}

static const meshrun_kit_plugin kit_llama = {
    sizeof(meshrun_kit_plugin),
    "kit_llama",
    "1.0.0",
    "Llama composed from the model kit (a test plugin: the kit against the hand-written llama)",
    config_keys,
    compose};

MESHRUN_KIT_DEFINE_PLUGIN(kit_llama)
