// Small compositions of the model kit (models/kit) for the tests of
// models/: Qwen2-like (attention biases), Phi-like (a parallel block,
// partial rotary, a final LayerNorm, lm_head's bias), GPT-2-like (LayerNorm,
// every bias, Conv1D projections, learned positions) and Mixtral-like (a
// mixture of experts between two norms), over a vocabulary of kVocab and
// sequences of kSeqLen.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

#include "kit/composition.hpp"

namespace kit_test {

using meshrun::kit::Composition;

constexpr int64_t kBatch = 2, kSeqLen = 6, kVocab = 11;
constexpr int32_t kBiases = MESHRUN_KIT_BIAS_IN | MESHRUN_KIT_BIAS_OUT;

const meshrun_kit_op kQwen2Layer[] = {
    {MESHRUN_KIT_RMSNORM, 0, "input_layernorm", "x", nullptr, "n1"},
    {MESHRUN_KIT_ATTENTION, MESHRUN_KIT_BIAS_IN, "self_attn", "n1", nullptr, "a"},
    {MESHRUN_KIT_ADD, 0, nullptr, "x", "a", "h"},
    {MESHRUN_KIT_RMSNORM, 0, "post_attention_layernorm", "h", nullptr, "n2"},
    {MESHRUN_KIT_SWIGLU_MLP, 0, "mlp", "n2", nullptr, "m"},
    {MESHRUN_KIT_ADD, 0, nullptr, "h", "m", "out"},
};

const meshrun_kit_op kGpt2Block[] = {
    {MESHRUN_KIT_LAYERNORM, 0, "ln_1", "x", nullptr, "n1"},
    {MESHRUN_KIT_ATTENTION, kBiases, "attn", "n1", nullptr, "a"},
    {MESHRUN_KIT_ADD, 0, nullptr, "x", "a", "h"},
    {MESHRUN_KIT_LAYERNORM, 0, "ln_2", "h", nullptr, "n2"},
    {MESHRUN_KIT_GELU_MLP, kBiases, "mlp", "n2", nullptr, "m"},
    {MESHRUN_KIT_ADD, 0, nullptr, "h", "m", "out"},
};

const meshrun_kit_op kPhiLayer[] = {
    {MESHRUN_KIT_LAYERNORM, 0, "input_layernorm", "x", nullptr, "n"},
    {MESHRUN_KIT_ATTENTION, kBiases, "self_attn", "n", nullptr, "a"},
    {MESHRUN_KIT_GELU_MLP, kBiases, "mlp", "n", nullptr, "m"},
    {MESHRUN_KIT_ADD, 0, nullptr, "a", "m", "am"},
    {MESHRUN_KIT_ADD, 0, nullptr, "x", "am", "out"},
};

// Mixtral's layer, with the mixture between two norms so that a view
// after the experts' is found on ranks holding some experts only.
const meshrun_kit_op kMixtralLayer[] = {
    {MESHRUN_KIT_RMSNORM, 0, "input_layernorm", "x", nullptr, "n1"},
    {MESHRUN_KIT_ATTENTION, 0, "self_attn", "n1", nullptr, "a"},
    {MESHRUN_KIT_ADD, 0, nullptr, "x", "a", "h"},
    {MESHRUN_KIT_RMSNORM, 0, "post_attention_layernorm", "h", nullptr, "n2"},
    {MESHRUN_KIT_MOE_MLP, 0, "block_sparse_moe", "n2", nullptr, "m"},
    {MESHRUN_KIT_RMSNORM, 0, "post_moe_layernorm", "m", nullptr, "n3"},
    {MESHRUN_KIT_ADD, 0, nullptr, "h", "n3", "out"},
};

inline meshrun_kit_model_spec base_spec(int64_t layers) {
  meshrun_kit_model_spec spec = meshrun::kit::default_spec();
  spec.vocab_size = kVocab;
  spec.hidden_size = 8;
  spec.intermediate_size = 12;
  spec.num_hidden_layers = layers;
  spec.num_attention_heads = 2;
  spec.num_key_value_heads = 1;
  spec.norm_eps = 1e-5;
  spec.rope_theta = 100.0;
  return spec;
}

inline Composition qwen2_like(int64_t layers) {
  meshrun_kit_model_spec spec = base_spec(layers);
  spec.ops = kQwen2Layer;
  spec.num_ops = 6;
  return meshrun::kit::compose(spec, "qwen2", nlohmann::ordered_json::object());
}

inline Composition phi_like(int64_t layers) {
  meshrun_kit_model_spec spec = base_spec(layers);
  spec.ops = kPhiLayer;
  spec.num_ops = 5;
  spec.partial_rotary_factor = 0.5;
  spec.final_norm = MESHRUN_KIT_LAYERNORM;
  spec.final_norm_name = "model.final_layernorm";
  spec.attention_output_name = "dense";
  spec.lm_head_bias = 1;
  return meshrun::kit::compose(spec, "phi", nlohmann::ordered_json::object());
}

inline meshrun_kit_model_spec gpt2_spec(int64_t layers) {
  meshrun_kit_model_spec spec = base_spec(layers);
  spec.ops = kGpt2Block;
  spec.num_ops = 6;
  spec.num_key_value_heads = 2;
  spec.final_norm = MESHRUN_KIT_LAYERNORM;
  spec.final_norm_name = "transformer.ln_f";
  spec.embedding_name = "transformer.wte";
  spec.position_embedding_name = "transformer.wpe";
  spec.max_position_embeddings = kSeqLen + 2;
  spec.layers_name = "transformer.h";
  spec.projections = MESHRUN_KIT_CONV1D;
  spec.scale_output_init = 1;
  spec.size_keys = R"({"hidden_size": "n_embd", "num_key_value_heads": null})";
  return spec;
}

inline Composition gpt2_like(int64_t layers) {
  return meshrun::kit::compose(gpt2_spec(layers), "gpt2", nlohmann::ordered_json::object());
}

inline meshrun_kit_model_spec mixtral_spec(int64_t layers, double aux_coef) {
  meshrun_kit_model_spec spec = base_spec(layers);
  spec.ops = kMixtralLayer;
  spec.num_ops = 7;
  spec.num_local_experts = 3;
  spec.num_experts_per_tok = 2;
  spec.router_aux_loss_coef = aux_coef;
  return spec;
}

inline Composition mixtral_like(int64_t layers, double aux_coef) {
  return meshrun::kit::compose(mixtral_spec(layers, aux_coef), "mixtral",
                               nlohmann::ordered_json::object());
}

}  // namespace kit_test
