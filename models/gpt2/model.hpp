// The GPT-2 family: Hugging Face's GPT2LMHeadModel (token embedding plus a
// learned position embedding; per layer h = x + attn.c_proj(attention(
// attn.c_attn(ln_1(x)))), out = h + mlp.c_proj(gelu_new(mlp.c_fc(ln_2(h))))
// with biases; final ln_f; logits by the tied wte or lm_head; mean
// cross-entropy) with float32 compute through OpenBLAS. This header holds
// what the whole model is: its configuration, its parameters in Hugging
// Face's names and order, and their initialization. stage.hpp computes any
// contiguous part of it.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/config_reader.hpp"
#include "common/parameters.hpp"
#include "common/tensor_parallel.hpp"

namespace meshrun::gpt2 {

// Hugging Face GPT2Config names and defaults, except the sizes: a byte
// vocabulary (Hugging Face: 50257) and a tiny model like the project's
// tiny Llama (Hugging Face: n_embd 768, n_layer 12, n_head 12).
// head_dim = n_embd / n_head; n_inner is resolved (null in Hugging Face
// means 4 * n_embd). activation_function is gelu_new and dropout is off:
// the only values the plugin takes.
struct Gpt2Config {
  int64_t vocab_size = 256;
  int64_t n_positions = 1024;
  int64_t n_embd = 256;
  int64_t n_layer = 4;
  int64_t n_head = 8;
  int64_t n_inner = 1024;
  double layer_norm_epsilon = 1e-5;
  double initializer_range = 0.02;
  bool tie_word_embeddings = true;
};

using models::ParameterView;

// Throws std::invalid_argument("model.<key>: ...") for sizes the
// architecture cannot take (the counts themselves are positive).
void check_config(const Gpt2Config& config);

// The [model] keys GPT2Config's names (kConfigKeys, NULL-terminated) set,
// checked. The dropout keys are taken at 0 only, so that a Hugging Face
// config.json reads as it is and the exported one says what was trained.
// Throws std::invalid_argument("model.<key>: ...").
extern const char* const kConfigKeys[];
Gpt2Config read_config(const models::ConfigReader& reader);

// Every key GPT2Config reads for the compute of GPT2LMHeadModel, resolved;
// n_ctx as Hugging Face's GPT-2 checkpoints write it.
nlohmann::ordered_json hf_config(const Gpt2Config& config);

// Every parameter in Hugging Face's order: transformer.wte.weight [V, E],
// transformer.wpe.weight [P, E]; per layer N, in unit N,
// transformer.h.N.{ln_1.{weight, bias}, attn.c_attn.{weight [E, 3E], bias},
// attn.c_proj.{weight [E, E], bias}, ln_2.{weight, bias},
// mlp.c_fc.{weight [E, I], bias}, mlp.c_proj.{weight [I, E], bias}}
// (Conv1D weights are [in, out]); transformer.ln_f.{weight, bias};
// lm_head.weight [V, E] unless tied; in DecoderUnits (wte in the root when
// tied). Without storage. Over tp (Megatron-LM's
// GPT-2): c_attn column-parallel ("shard(1,3)": each rank's columns of q, k
// and v), c_fc column-parallel ("shard(1)") with their biases; the c_proj
// weights row-parallel ("shard(0)": their input rows), their biases and the
// norms replicated; wte and lm_head vocabulary-parallel ("shard(0)"), wpe
// replicated.
std::vector<ParameterView> model_parameters(const Gpt2Config& config);

// The block of a parameter sharded so, none for a replicated one; and the
// blocks (attention, mlp, wte, lm_head unless tied) with their modules'
// torch styles, which distributed.tp_plan may replicate whole.
std::optional<models::Block> tensor_parallel_block(const std::string& name);
std::vector<models::BlockSpec> tensor_parallel_blocks(const Gpt2Config& config);

// Throws std::invalid_argument("model.<key>: ...") unless what the parallel
// `blocks` split divides over tp ranks: the heads, the inner size, the
// vocabulary.
void check_tensor_parallel(const Gpt2Config& config, int64_t tp,
                           const models::ParallelBlocks& blocks);

// Initial values of parameters[index] for `seed`, Hugging Face's
// _init_weights: matrices (embeddings, Conv1D and lm_head weights) ~
// normal(0, initializer_range) but the c_proj weights ~ normal(0,
// initializer_range / sqrt(2 n_layer)); biases 0; LayerNorm weights 1.
// Drawn from one stream over the model's matrices in order
// (models::init_normal), so any parameter can be made alone.
void init_parameter(const Gpt2Config& config, const std::vector<ParameterView>& parameters,
                    uint64_t seed, int64_t index, float* values);

}  // namespace meshrun::gpt2
