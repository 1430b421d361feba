#include "llama/model.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace meshrun::llama {

using models::add_parameter;

namespace {

bool is_norm(const ParameterView& view) { return view.shape.size() == 1; }

// Messages begin with the config key, as meshrun/model.h asks.
void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument(message);
}

}  // namespace

void check_config(const LlamaConfig& c) {
  require(c.hidden_size % c.num_attention_heads == 0,
          "model.hidden_size: " + std::to_string(c.hidden_size) +
              " must be divisible by model.num_attention_heads (" +
              std::to_string(c.num_attention_heads) + ")");
  require(c.num_attention_heads % c.num_key_value_heads == 0,
          "model.num_key_value_heads: model.num_attention_heads (" +
              std::to_string(c.num_attention_heads) + ") must be divisible by it (" +
              std::to_string(c.num_key_value_heads) + ")");
  const int64_t head_dim = c.hidden_size / c.num_attention_heads;
  require(head_dim % 2 == 0,
          "model.hidden_size: the head dimension model.hidden_size / model.num_attention_heads = " +
              std::to_string(c.hidden_size) + " / " + std::to_string(c.num_attention_heads) +
              " = " + std::to_string(head_dim) +
              " must be even (rotary embeddings rotate channel pairs)");
}

std::string tensor_parallel_placement(const std::string& name) {
  const auto in = [&](const char* module) {
    return name.find(std::string(".") + module + ".") != std::string::npos;
  };
  for (const char* column : {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}) {
    if (in(column)) return "shard(0)";
  }
  if (in("o_proj") || in("down_proj")) return "shard(1)";
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return "shard(0)";
  return "replicate";
}

void check_tensor_parallel(const LlamaConfig& c, int64_t tp) {
  for (const auto& [key, value] : {std::pair{"num_attention_heads", c.num_attention_heads},
                                   {"num_key_value_heads", c.num_key_value_heads},
                                   {"intermediate_size", c.intermediate_size},
                                   {"vocab_size", c.vocab_size}}) {
    require(value % tp == 0, std::string("model.") + key + ": " + std::to_string(value) +
                                 " is not divisible by distributed.tp_size = " +
                                 std::to_string(tp) + ", over which tensor parallelism splits it");
  }
}

std::vector<ParameterView> model_parameters(const LlamaConfig& config) {
  const int64_t H = config.hidden_size, I = config.intermediate_size;
  const int64_t head_dim = H / config.num_attention_heads;
  const int64_t q_dim = config.num_attention_heads * head_dim;
  const int64_t kv_dim = config.num_key_value_heads * head_dim;
  const int64_t root = root_unit(config);
  std::vector<ParameterView> views;
  add_parameter(views, "model.embed_tokens.weight", {config.vocab_size, H}, root);
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".";
    add_parameter(views, prefix + "input_layernorm.weight", {H}, layer);
    add_parameter(views, prefix + "self_attn.q_proj.weight", {q_dim, H}, layer);
    add_parameter(views, prefix + "self_attn.k_proj.weight", {kv_dim, H}, layer);
    add_parameter(views, prefix + "self_attn.v_proj.weight", {kv_dim, H}, layer);
    add_parameter(views, prefix + "self_attn.o_proj.weight", {H, q_dim}, layer);
    add_parameter(views, prefix + "post_attention_layernorm.weight", {H}, layer);
    add_parameter(views, prefix + "mlp.gate_proj.weight", {I, H}, layer);
    add_parameter(views, prefix + "mlp.up_proj.weight", {I, H}, layer);
    add_parameter(views, prefix + "mlp.down_proj.weight", {H, I}, layer);
  }
  add_parameter(views, "model.norm.weight", {H}, root);
  if (!config.tie_word_embeddings)
    add_parameter(views, "lm_head.weight", {config.vocab_size, H}, root);
  for (ParameterView& view : views) view.tp = tensor_parallel_placement(view.name);
  models::require_addressable(
      views, {{"vocab_size", config.vocab_size}, {"hidden_size", H}, {"intermediate_size", I}});
  return views;
}

void init_parameter(const std::vector<ParameterView>& parameters, uint64_t seed, int64_t index,
                    float* values) {
  const ParameterView& view = parameters.at(size_t(index));
  if (is_norm(view)) {
    std::fill_n(values, view.numel, 1.0f);
    return;
  }
  models::init_normal(parameters, seed, index, 0.02, values);
}

}  // namespace meshrun::llama
