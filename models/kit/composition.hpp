// A kit-composed model (meshrun/kit.h) as the kit computes it: the sizes,
// the decoder layer's ops over numbered tensors, checked once when the
// model is made, and what follows from them alone — the parameters in
// Hugging Face's names, their tensor-parallel placement and blocks, the
// pipeline modules and the description's size figures. composed.hpp
// computes it.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/description.hpp"
#include "common/parameters.hpp"
#include "common/tensor_parallel.hpp"
#include "meshrun/kit.h"

namespace meshrun::kit {

using models::ParameterView;

enum class Op {
  rmsnorm = MESHRUN_KIT_RMSNORM,
  layernorm = MESHRUN_KIT_LAYERNORM,
  attention = MESHRUN_KIT_ATTENTION,
  swiglu_mlp = MESHRUN_KIT_SWIGLU_MLP,
  gelu_mlp = MESHRUN_KIT_GELU_MLP,
  add = MESHRUN_KIT_ADD,
  moe_mlp = MESHRUN_KIT_MOE_MLP,
};

inline bool is_norm(Op op) { return op == Op::rmsnorm || op == Op::layernorm; }
// The dense MLPs, which tensor parallelism splits; not MOE_MLP.
inline bool is_mlp(Op op) { return op == Op::swiglu_mlp || op == Op::gelu_mlp; }

// An op of the decoder layer. Tensors are numbered: 0 is the layer's input
// "x", op i writes tensor i + 1.
struct LayerOp {
  Op op;
  std::string name;
  bool bias_in = false, bias_out = false;
  int input = 0, input2 = -1, output = 0;
  // Its parameters: views [first_view, first_view + views) of a layer
  // whose experts are all on the rank (Pass::first_view has a rank's).
  int64_t first_view = 0, views = 0;
  // Whether a backward reads its output's values (a norm, attention or MLP
  // reads it), so a forward keeps it; else it is scratch of the pass.
  bool keeps_output = false;
  // Whether this op is the last one in the backward to read its input's
  // values, so the input may move to a split backward's weight pass.
  bool last_input_reader = false;
  // Whether an attention or MLP reads its output: with sequence parallelism
  // the output is then gathered from every tp rank's rows.
  bool gathered_output = false;
};

struct Composition {
  std::string model_type, architecture, layer_class;
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0;
  int64_t num_attention_heads = 0, num_key_value_heads = 0;
  // The MOE_MLP ops' experts, each token's, and the load-balancing loss's
  // weight; 0 without one.
  int64_t num_local_experts = 0, num_experts_per_tok = 0;
  double router_aux_loss_coef = 0;
  // The longest sequence (the learned position table's rows); 0: no limit.
  int64_t max_position_embeddings = 0;
  double norm_eps = 0, rope_theta = 10000, partial_rotary_factor = 1;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false, lm_head_bias = false;
  // GPT-2's Conv1D projections ([in, out], q/k/v fused as c_attn), and its
  // output projections' initialization scaled by 1 / sqrt(2 layers).
  bool conv1d = false, scale_output_init = false;
  Op final_norm = Op::rmsnorm;
  std::string final_norm_name = "model.norm", attention_output_name = "o_proj";
  std::string embedding_name = "model.embed_tokens", layers_name = "model.layers";
  std::string position_embedding_name;  // learned positions; empty: rotary
  // The config.json key of each size the user renamed (kit.h size_keys):
  // a string, or null to leave the size out.
  nlohmann::ordered_json size_keys = nlohmann::ordered_json::object();
  std::vector<LayerOp> ops;
  std::vector<std::string> tensors;  // names, "x" first
  // Why the layer cannot compute sequence parallelism, or empty: it can
  // when every attention and MLP reads a norm's output that only attention
  // and MLPs read (the norm then runs on the rank's rows and gathers).
  std::string sequence_parallel_refusal;
  nlohmann::ordered_json config_extra = nlohmann::ordered_json::object();

  bool learned_positions() const { return !position_embedding_name.empty(); }
  // The config.json key of size `size` (a kit name), or "" when left out.
  std::string size_key(const std::string& size) const;
  // The [model] key that sets size `size`: its config.json key, or the
  // kit's name when the size is left out of config.json.
  std::string size_name(const std::string& size) const;
  std::string layer_prefix() const { return layers_name + "."; }
  std::string embedding_weight() const { return embedding_name + ".weight"; }
  std::string position_weight() const { return position_embedding_name + ".weight"; }
  // The parameters of the embedding stage: the token table, then the
  // position table's.
  int64_t embedding_views() const { return learned_positions() ? 2 : 1; }
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t rotary_dim() const { return int64_t(double(head_dim()) * partial_rotary_factor); }
  int64_t q_dim() const { return num_attention_heads * head_dim(); }
  int64_t kv_dim() const { return num_key_value_heads * head_dim(); }
  int64_t attention_ops() const;
  int64_t moe_ops() const;
  // The first view of each op in a layer of which the rank holds
  // `local_experts` experts of each MOE_MLP.
  std::vector<int64_t> first_views(int64_t local_experts) const;
  // The head's views on the last stage: the final norm's weight (and bias),
  // lm_head's bias, then lm_head's weight unless tied.
  int64_t final_norm_views() const { return final_norm == Op::layernorm ? 2 : 1; }
};

// A spec as a plugin's compose call receives it: zeroed, struct_size and
// the defaults kit.h notes set.
meshrun_kit_model_spec default_spec();

// The composition of `spec`, checked, for a [model] config whose set keys
// are `user_config` (a JSON object). Throws std::invalid_argument: sizes as
// "model.<key>: ...", ops as "kit: layer op <i> '<name>' ...".
Composition compose(const meshrun_kit_model_spec& spec, const std::string& model_type,
                    const nlohmann::ordered_json& user_config);

// Every parameter in the kit's order: the token embedding's, the position
// embedding's; per layer each op's (kit.h); the final norm's; lm_head.bias;
// lm_head.weight unless tied. Each with its tensor-parallel placement.
std::vector<ParameterView> parameters(const Composition& c);
// Matrices ~ normal(0, initializer_range) (the output projections' scaled
// with scale_output_init), norm weights 1, biases 0.
void init_parameter(const Composition& c, const std::vector<ParameterView>& parameters,
                    uint64_t seed, int64_t index, float* values);

// The tp block of a parameter the kit computes over tp.
std::optional<models::Block> tensor_parallel_block(const Composition& c,
                                                   const std::string& parameter);
std::vector<models::BlockSpec> tensor_parallel_blocks(const Composition& c);
void check_tensor_parallel(const Composition& c, int64_t tp, const models::ParallelBlocks& blocks);

models::ModelModules modules(const Composition& c);
// The description JSON (meshrun/model.h); its "devices" are the CPU, and
// CUDA GPUs too with `on_cuda`.
std::string describe(const Composition& c, const std::vector<ParameterView>& parameters,
                     bool on_cuda = false);

}  // namespace meshrun::kit
