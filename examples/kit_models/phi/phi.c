/*
 * phi — a meshrun model plugin in plain C11 composed from the model kit
 * (meshrun/kit.h), model_type "phi": Hugging Face's PhiForCausalLM, whose
 * decoder layer runs attention and the MLP side by side on one LayerNorm:
 *
 *   n   = input_layernorm(x)                          (LayerNorm, with bias)
 *   out = x + dense(attention(rope(q/k/v_proj(n))))  + fc2(gelu_new(fc1(n)))
 *
 * with biases on every projection, rotary embeddings on the first
 * partial_rotary_factor of each head, a final LayerNorm and an lm_head with
 * a bias. The layer below is all the model code; the kit computes the rest.
 */
#include <stddef.h>
#include <stdint.h>

#include "meshrun/kit.h"

#define BIASES (MESHRUN_KIT_BIAS_IN | MESHRUN_KIT_BIAS_OUT)

/* The decoder layer, in Hugging Face's module names. */
static const meshrun_kit_op layer[] = {
    {MESHRUN_KIT_LAYERNORM, 0, "input_layernorm", "x", NULL, "n"},
    {MESHRUN_KIT_ATTENTION, BIASES, "self_attn", "n", NULL, "attention"},
    {MESHRUN_KIT_GELU_MLP, BIASES, "mlp", "n", NULL, "mlp"},
    {MESHRUN_KIT_ADD, 0, NULL, "attention", "mlp", "branches"},
    {MESHRUN_KIT_ADD, 0, NULL, "x", "branches", "out"},
};

/* PhiConfig's defaults for what [model] may leave unset; the sizes have
 * small defaults of our own so that a config trains on a CPU. */
#define LAYER_NORM_EPS 1e-5
#define ROPE_THETA 10000.0
#define PARTIAL_ROTARY_FACTOR 0.5
#define MAX_POSITIONS 2048
#define LARGEST ((int64_t)1 << 30)
static const char config_defaults[] =
    "{\"hidden_act\": \"gelu_new\", \"layer_norm_eps\": 1e-05, \"rope_theta\": 10000.0,"
    " \"partial_rotary_factor\": 0.5, \"max_position_embeddings\": 2048,"
    " \"qk_layernorm\": false, \"resid_pdrop\": 0.0, \"embd_pdrop\": 0.0,"
    " \"attention_dropout\": 0.0}";

static const char* const config_keys[] = {"vocab_size",
                                          "hidden_size",
                                          "intermediate_size",
                                          "num_hidden_layers",
                                          "num_attention_heads",
                                          "num_key_value_heads",
                                          "layer_norm_eps",
                                          "rope_theta",
                                          "partial_rotary_factor",
                                          "max_position_embeddings",
                                          NULL};

/* Calls a kit reader; returns its error from the enclosing function. */
#define READ(call)                     \
  do {                                 \
    meshrun_error* error_ = (call);    \
    if (error_ != NULL) return error_; \
  } while (0)

static meshrun_error* compose(const meshrun_kit_config* config, meshrun_kit_model_spec* spec) {
  int64_t max_positions = 0;
  READ(meshrun_kit_config_integer(config, "vocab_size", 256, 1, LARGEST, &spec->vocab_size));
  READ(meshrun_kit_config_integer(config, "hidden_size", 64, 1, LARGEST, &spec->hidden_size));
  READ(meshrun_kit_config_integer(config, "intermediate_size", 256, 1, LARGEST,
                                  &spec->intermediate_size));
  READ(meshrun_kit_config_integer(config, "num_hidden_layers", 2, 1, 2048,
                                  &spec->num_hidden_layers));
  READ(meshrun_kit_config_integer(config, "num_attention_heads", 4, 1, LARGEST,
                                  &spec->num_attention_heads));
  READ(meshrun_kit_config_integer(config, "num_key_value_heads", spec->num_attention_heads, 1,
                                  LARGEST, &spec->num_key_value_heads));
  READ(meshrun_kit_config_positive(config, "layer_norm_eps", LAYER_NORM_EPS, &spec->norm_eps));
  READ(meshrun_kit_config_positive(config, "rope_theta", ROPE_THETA, &spec->rope_theta));
  READ(meshrun_kit_config_positive(config, "partial_rotary_factor", PARTIAL_ROTARY_FACTOR,
                                   &spec->partial_rotary_factor));
  READ(meshrun_kit_config_integer(config, "max_position_embeddings", MAX_POSITIONS, 1, LARGEST,
                                  &max_positions));
  spec->num_ops = sizeof layer / sizeof layer[0];
  spec->ops = layer;
  spec->final_norm = MESHRUN_KIT_LAYERNORM;
  spec->final_norm_name = "model.final_layernorm";
  spec->attention_output_name = "dense";
  spec->lm_head_bias = 1;
  spec->architecture = "PhiForCausalLM";
  spec->layer_class = "PhiDecoderLayer";
  spec->config_json = config_defaults;
  return NULL;
}

static const meshrun_kit_plugin phi = {
    sizeof(meshrun_kit_plugin),
    "phi",
    "1.0.0",
    "Phi (PhiForCausalLM): a parallel attention + MLP block, composed from the meshrun model kit",
    config_keys,
    compose};

MESHRUN_KIT_DEFINE_PLUGIN(phi)
