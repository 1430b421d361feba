#include "llama/model.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace meshrun::llama {

using models::add_parameter;
using models::Block;
using models::DecoderUnits;

namespace {

bool is_norm(const ParameterView& view) { return view.shape.size() == 1; }

// Messages begin with the config key, as meshrun/model.h asks.
void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument(message);
}

}  // namespace

void check_config(const LlamaConfig& c) {
  models::require_attention_heads(c.hidden_size, c.num_attention_heads, c.num_key_value_heads);
  const int64_t head_dim = c.hidden_size / c.num_attention_heads;
  require(head_dim % 2 == 0,
          "model.hidden_size: the head dimension model.hidden_size / model.num_attention_heads = " +
              std::to_string(c.hidden_size) + " / " + std::to_string(c.num_attention_heads) +
              " = " + std::to_string(head_dim) +
              " must be even (rotary embeddings rotate channel pairs)");
}

namespace {

const models::ParallelModules kParallelModules = {
    "model.layers.",
    {{"self_attn.q_proj", "shard(0)", "replicate", Block::attention, "colwise"},
     {"self_attn.k_proj", "shard(0)", "replicate", Block::attention, "colwise"},
     {"self_attn.v_proj", "shard(0)", "replicate", Block::attention, "colwise"},
     {"self_attn.o_proj", "shard(1)", "replicate", Block::attention, "rowwise"},
     {"mlp.gate_proj", "shard(0)", "replicate", Block::mlp, "colwise"},
     {"mlp.up_proj", "shard(0)", "replicate", Block::mlp, "colwise"},
     {"mlp.down_proj", "shard(1)", "replicate", Block::mlp, "rowwise"}},
    {{"model.embed_tokens", "shard(0)", "replicate", Block::embedding, "rowwise"},
     {"lm_head", "shard(0)", "replicate", Block::head, "colwise"}}};

}  // namespace

std::string tensor_parallel_placement(const std::string& name) {
  return kParallelModules.placement(name);
}

std::optional<Block> tensor_parallel_block(const std::string& name) {
  return kParallelModules.block(name);
}

std::vector<models::BlockSpec> tensor_parallel_blocks(const LlamaConfig& config) {
  return kParallelModules.specs(config.tie_word_embeddings);
}

void check_tensor_parallel(const LlamaConfig& c, int64_t tp, const models::ParallelBlocks& blocks) {
  const bool vocab = blocks[Block::embedding] || blocks[Block::head];
  models::require_divisible(
      {{"num_attention_heads", c.num_attention_heads, blocks[Block::attention]},
       {"num_key_value_heads", c.num_key_value_heads, blocks[Block::attention]},
       {"intermediate_size", c.intermediate_size, blocks[Block::mlp]},
       {"vocab_size", c.vocab_size, vocab}},
      tp);
}

void add_attention_parameters(std::vector<ParameterView>& views, const LlamaConfig& config,
                              int64_t layer) {
  const int64_t H = config.hidden_size;
  const int64_t head_dim = H / config.num_attention_heads;
  const int64_t q_dim = config.num_attention_heads * head_dim;
  const int64_t kv_dim = config.num_key_value_heads * head_dim;
  const std::string prefix = "model.layers." + std::to_string(layer) + ".";
  add_parameter(views, prefix + "input_layernorm.weight", {H}, layer);
  add_parameter(views, prefix + "self_attn.q_proj.weight", {q_dim, H}, layer);
  add_parameter(views, prefix + "self_attn.k_proj.weight", {kv_dim, H}, layer);
  add_parameter(views, prefix + "self_attn.v_proj.weight", {kv_dim, H}, layer);
  add_parameter(views, prefix + "self_attn.o_proj.weight", {H, q_dim}, layer);
  add_parameter(views, prefix + "post_attention_layernorm.weight", {H}, layer);
}

const char* const kDecoderConfigKeys[] = {"vocab_size",
                                          "hidden_size",
                                          "intermediate_size",
                                          "num_hidden_layers",
                                          "num_attention_heads",
                                          "num_key_value_heads",
                                          "max_position_embeddings",
                                          "rms_norm_eps",
                                          "rope_theta",
                                          "tie_word_embeddings",
                                          nullptr};

void set_kit_decoder(const LlamaConfig& c, meshrun_kit_model_spec& spec) {
  spec.vocab_size = c.vocab_size;
  spec.hidden_size = c.hidden_size;
  spec.intermediate_size = c.intermediate_size;
  spec.num_hidden_layers = c.num_hidden_layers;
  spec.num_attention_heads = c.num_attention_heads;
  spec.num_key_value_heads = c.num_key_value_heads;
  spec.norm_eps = c.rms_norm_eps;
  spec.rope_theta = c.rope_theta;
  spec.tie_word_embeddings = c.tie_word_embeddings;
}

LlamaConfig read_decoder_config(const models::ConfigReader& reader, LlamaConfig c) {
  c.vocab_size = reader.dimension("vocab_size", c.vocab_size);
  c.hidden_size = reader.dimension("hidden_size", c.hidden_size);
  c.intermediate_size = reader.dimension("intermediate_size", c.intermediate_size);
  c.num_hidden_layers =
      reader.integer("num_hidden_layers", c.num_hidden_layers, 1, models::kMaxLayers);
  c.num_attention_heads = reader.integer("num_attention_heads", c.num_attention_heads);
  // Hugging Face's default: one key/value head per attention head.
  c.num_key_value_heads = reader.integer("num_key_value_heads", c.num_attention_heads);
  c.max_position_embeddings = reader.integer("max_position_embeddings", c.max_position_embeddings);
  c.rms_norm_eps = reader.positive_number("rms_norm_eps", c.rms_norm_eps);
  c.rope_theta = reader.positive_number("rope_theta", c.rope_theta);
  c.tie_word_embeddings = reader.boolean("tie_word_embeddings", c.tie_word_embeddings);
  check_config(c);
  return c;
}

models::ModelModules decoder_modules(bool tie_word_embeddings) {
  const std::string embedding = "model.embed_tokens.weight";
  return {{{"model.embed_tokens", {embedding}, ""}},
          "model.layers.",
          {{"model.norm", {"model.norm.weight"}, "head"},
           {"lm_head", {tie_word_embeddings ? embedding : "lm_head.weight"}, "head"}}};
}

std::vector<ParameterView> model_parameters(const LlamaConfig& config) {
  const int64_t H = config.hidden_size, I = config.intermediate_size;
  const DecoderUnits units(config.num_hidden_layers);
  std::vector<ParameterView> views;
  add_parameter(views, "model.embed_tokens.weight", {config.vocab_size, H},
                units.token_embedding(config.tie_word_embeddings));
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".";
    add_attention_parameters(views, config, layer);
    add_parameter(views, prefix + "mlp.gate_proj.weight", {I, H}, layer);
    add_parameter(views, prefix + "mlp.up_proj.weight", {I, H}, layer);
    add_parameter(views, prefix + "mlp.down_proj.weight", {H, I}, layer);
  }
  add_parameter(views, "model.norm.weight", {H}, units.head);
  if (!config.tie_word_embeddings)
    add_parameter(views, "lm_head.weight", {config.vocab_size, H}, units.head);
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
