// The Llama family: Hugging Face's LlamaForCausalLM (embedding; per layer
// h = x + o_proj(attn(rmsnorm(x))), out = h + down(silu(gate(rmsnorm(h))) *
// up(rmsnorm(h))); final rmsnorm; lm_head; mean cross-entropy) with float32
// compute through OpenBLAS. This header holds what the whole model is: its
// configuration, its parameters in Hugging Face's names and order, and their
// initialization. stage.hpp computes any contiguous part of it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/config_reader.hpp"
#include "common/description.hpp"
#include "common/parameters.hpp"
#include "common/tensor_parallel.hpp"
#include "meshrun/kit.h"

namespace meshrun::llama {

// Hugging Face config.json names. head_dim = hidden_size / num_attention_heads.
struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t hidden_size = 256;
  int64_t intermediate_size = 768;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 8;
  int64_t num_key_value_heads = 8;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
};

using models::ParameterView;

// Throws std::invalid_argument("model.<key>: ...") for sizes the
// architecture cannot take (the counts themselves are positive).
void check_config(const LlamaConfig& config);

// Every parameter in Hugging Face's order: model.embed_tokens.weight; per
// layer N model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
// post_attention_layernorm, mlp.{gate,up,down}_proj}.weight;
// model.norm.weight; lm_head.weight unless tied. Without storage.
std::vector<ParameterView> model_parameters(const LlamaConfig& config);

// A decoder layer's attention half in Hugging Face's names, appended to
// `views`: model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
// post_attention_layernorm}.weight (the Mixtral family shares it).
void add_attention_parameters(std::vector<ParameterView>& views, const LlamaConfig& config,
                              int64_t layer);

// The [model] keys of the decoder's sizes (Hugging Face's names), over
// `defaults`, checked; and the modules a pipeline may cut between: the
// embedding, the layers, the head (final norm and lm_head, inseparable: the
// loss needs both; a tied lm_head uses the embedding).
LlamaConfig read_decoder_config(const models::ConfigReader& reader, LlamaConfig defaults);
// The keys read_decoder_config reads, NULL-terminated (meshrun/model.h
// config_keys).
extern const char* const kDecoderConfigKeys[];
// The decoder's sizes, norm epsilon, rotary base and tying into a model kit
// spec (meshrun/kit.h): what the Llama and Mixtral compositions share.
void set_kit_decoder(const LlamaConfig& config, meshrun_kit_model_spec& spec);
models::ModelModules decoder_modules(bool tie_word_embeddings);

// Megatron-LM's tensor parallelism as AutoModel's Llama plan places it:
// q, k, v, gate and up column-wise ("shard(0)": the rank's output rows), o
// and down row-wise ("shard(1)": its input columns), the embedding and
// lm_head vocabulary-parallel ("shard(0)"), the norms "replicate".
std::string tensor_parallel_placement(const std::string& name);
// The block of a parameter placed so, none for a replicated one; and the
// blocks (attention, mlp, embedding, lm_head unless tied) with their
// modules' torch styles, which distributed.tp_plan may replicate whole.
std::optional<models::Block> tensor_parallel_block(const std::string& name);
std::vector<models::BlockSpec> tensor_parallel_blocks(const LlamaConfig& config);

// Throws std::invalid_argument("model.<key>: ...") unless what the parallel
// `blocks` split divides over tp ranks: the heads and key/value heads
// (AutoModel's _validate_tp_mesh), the intermediate size, the vocabulary.
void check_tensor_parallel(const LlamaConfig& config, int64_t tp,
                           const models::ParallelBlocks& blocks);

// Initial values of parameters[index] for `seed`: matrices ~ normal(0,
// 0.02), norms 1, drawn from one splitmix64 + Box-Muller stream over the
// model's matrices in order, so a seed gives the same weights with any
// standard library and any parameter can be made alone.
void init_parameter(const std::vector<ParameterView>& parameters, uint64_t seed, int64_t index,
                    float* values);

}  // namespace meshrun::llama
