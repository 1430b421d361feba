// The Mixtral family: Hugging Face's MixtralForCausalLM, Llama's decoder
// with each layer's MLP replaced by a sparse mixture of experts
// (block_sparse_moe): a router (gate) scores the num_local_experts experts
// per token, the top num_experts_per_tok of the softmax are kept and
// renormalized, and the token's output is the weighted sum of those
// experts' SwiGLU MLPs (w2(silu(w1 x) * w3 x)). Dropless, as Mixtral is:
// every expert takes every token routed to it. The router's
// load-balancing loss (router_aux_loss_coef) joins the objective. This
// header holds the configuration, the parameters in Hugging Face's names
// and their initialization, the [model] keys' reading and the Hugging Face
// config.json; moe.hpp computes a stage (the hand-written family, the
// oracle of the kit composition models/mixtral/plugin.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "common/config_reader.hpp"
#include "common/parameters.hpp"
#include "llama/model.hpp"

namespace meshrun::mixtral {

using models::ParameterView;

// Hugging Face config.json names; the decoder's sizes are Llama's, with
// intermediate_size each expert's.
struct MixtralConfig : llama::LlamaConfig {
  int64_t num_local_experts = 8;
  int64_t num_experts_per_tok = 2;
  double router_aux_loss_coef = 0.001;
};

// Throws std::invalid_argument("model.<key>: ...") for sizes the
// architecture cannot take.
void check_config(const MixtralConfig& config);

// The [model] keys read_config reads, NULL-terminated: Llama's decoder
// keys, then the routing's.
const std::vector<const char*>& config_keys();
// meshrun's tiny defaults for the sizes (as its Llama's), Mixtral's for the
// routing; checked. Throws std::invalid_argument("model.<key>: ...").
MixtralConfig read_config(const models::ConfigReader& reader);
// Every key MixtralConfig reads for the compute of MixtralForCausalLM,
// resolved.
nlohmann::ordered_json hf_config(const MixtralConfig& config);

// Every parameter in order: model.embed_tokens.weight; per layer N
// model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
// post_attention_layernorm, block_sparse_moe.gate}.weight and per expert J
// model.layers.N.block_sparse_moe.experts.J.{w1, w3, w2}.weight (w1 and w3
// adjacent: one fused [2I, H] projection); model.norm.weight; lm_head.weight
// unless tied. Expert parameters carry their expert's number.
std::vector<ParameterView> model_parameters(const MixtralConfig& config);

// Initial values of parameters[index] for `seed`: Llama's (matrices ~
// normal(0, 0.02), norms 1).
void init_parameter(const std::vector<ParameterView>& parameters, uint64_t seed, int64_t index,
                    float* values);

}  // namespace meshrun::mixtral
