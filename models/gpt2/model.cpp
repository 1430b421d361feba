#include "gpt2/model.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace meshrun::gpt2 {

using models::add_parameter;
using models::Block;
using models::DecoderUnits;

namespace {

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Megatron-LM's GPT-2 (model_parameters's comment). A Conv1D's weight is
// [in, out], so a column-wise one shards dimension 1.
const models::ParallelModules kParallelModules = {
    "transformer.h.",
    {{"attn.c_attn", "shard(1,3)", "shard(0,3)", Block::attention, "colwise"},
     {"attn.c_proj", "shard(0)", "replicate", Block::attention, "rowwise"},
     {"mlp.c_fc", "shard(1)", "shard(0)", Block::mlp, "colwise"},
     {"mlp.c_proj", "shard(0)", "replicate", Block::mlp, "rowwise"}},
    {{"transformer.wte", "shard(0)", "replicate", Block::embedding, "rowwise"},
     {"lm_head", "shard(0)", "replicate", Block::head, "colwise"}}};

void add_layer(std::vector<ParameterView>& views, const Gpt2Config& c, int64_t layer) {
  const int64_t E = c.n_embd, I = c.n_inner;
  const std::string p = "transformer.h." + std::to_string(layer) + ".";
  add_parameter(views, p + "ln_1.weight", {E}, layer);
  add_parameter(views, p + "ln_1.bias", {E}, layer);
  add_parameter(views, p + "attn.c_attn.weight", {E, 3 * E}, layer);
  add_parameter(views, p + "attn.c_attn.bias", {3 * E}, layer);
  add_parameter(views, p + "attn.c_proj.weight", {E, E}, layer);
  add_parameter(views, p + "attn.c_proj.bias", {E}, layer);
  add_parameter(views, p + "ln_2.weight", {E}, layer);
  add_parameter(views, p + "ln_2.bias", {E}, layer);
  add_parameter(views, p + "mlp.c_fc.weight", {E, I}, layer);
  add_parameter(views, p + "mlp.c_fc.bias", {I}, layer);
  add_parameter(views, p + "mlp.c_proj.weight", {I, E}, layer);
  add_parameter(views, p + "mlp.c_proj.bias", {E}, layer);
}

}  // namespace

void check_config(const Gpt2Config& c) {
  if (c.n_embd % c.n_head != 0) {
    throw std::invalid_argument("model.n_embd: " + std::to_string(c.n_embd) +
                                " must be divisible by model.n_head (" + std::to_string(c.n_head) +
                                ")");
  }
}

const char* const kConfigKeys[] = {"vocab_size",
                                   "n_positions",
                                   "n_embd",
                                   "n_layer",
                                   "n_head",
                                   "n_inner",
                                   "activation_function",
                                   "layer_norm_epsilon",
                                   "initializer_range",
                                   "tie_word_embeddings",
                                   "resid_pdrop",
                                   "embd_pdrop",
                                   "attn_pdrop",
                                   nullptr};

Gpt2Config read_config(const models::ConfigReader& reader) {
  Gpt2Config c;
  c.vocab_size = reader.dimension("vocab_size", c.vocab_size);
  c.n_positions = reader.dimension("n_positions", c.n_positions);
  c.n_embd = reader.dimension("n_embd", c.n_embd);
  c.n_layer = reader.integer("n_layer", c.n_layer, 1, models::kMaxLayers);
  c.n_head = reader.integer("n_head", c.n_head);
  c.n_inner = reader.nullable_integer("n_inner", 4 * c.n_embd);
  reader.choice("activation_function", "gelu_new", {"gelu_new"});
  c.layer_norm_epsilon = reader.positive_number("layer_norm_epsilon", c.layer_norm_epsilon);
  c.initializer_range = reader.positive_number("initializer_range", c.initializer_range);
  c.tie_word_embeddings = reader.boolean("tie_word_embeddings", c.tie_word_embeddings);
  for (const char* dropout : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) {
    reader.require_number(dropout, 0.0, "training here has no dropout");
  }
  check_config(c);
  return c;
}

nlohmann::ordered_json hf_config(const Gpt2Config& c) {
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", c.vocab_size},
          {"n_positions", c.n_positions},
          {"n_ctx", c.n_positions},
          {"n_embd", c.n_embd},
          {"n_layer", c.n_layer},
          {"n_head", c.n_head},
          {"n_inner", c.n_inner},
          {"activation_function", "gelu_new"},
          {"resid_pdrop", 0.0},
          {"embd_pdrop", 0.0},
          {"attn_pdrop", 0.0},
          {"layer_norm_epsilon", c.layer_norm_epsilon},
          {"initializer_range", c.initializer_range},
          {"scale_attn_weights", true},
          {"scale_attn_by_inverse_layer_idx", false},
          {"reorder_and_upcast_attn", false},
          {"tie_word_embeddings", c.tie_word_embeddings}};
}

std::optional<Block> tensor_parallel_block(const std::string& name) {
  return kParallelModules.block(name);
}

std::vector<models::BlockSpec> tensor_parallel_blocks(const Gpt2Config& config) {
  return kParallelModules.specs(config.tie_word_embeddings);
}

void check_tensor_parallel(const Gpt2Config& c, int64_t tp, const models::ParallelBlocks& blocks) {
  models::require_divisible(
      {{"n_head", c.n_head, blocks[Block::attention]},
       {"n_inner", c.n_inner, blocks[Block::mlp]},
       {"vocab_size", c.vocab_size, blocks[Block::embedding] || blocks[Block::head]}},
      tp);
}

std::vector<ParameterView> model_parameters(const Gpt2Config& c) {
  const int64_t E = c.n_embd;
  const DecoderUnits units(c.n_layer);
  std::vector<ParameterView> views;
  add_parameter(views, "transformer.wte.weight", {c.vocab_size, E},
                units.token_embedding(c.tie_word_embeddings));
  add_parameter(views, "transformer.wpe.weight", {c.n_positions, E}, units.embedding);
  for (int64_t layer = 0; layer < c.n_layer; ++layer) add_layer(views, c, layer);
  add_parameter(views, "transformer.ln_f.weight", {E}, units.head);
  add_parameter(views, "transformer.ln_f.bias", {E}, units.head);
  if (!c.tie_word_embeddings) {
    add_parameter(views, "lm_head.weight", {c.vocab_size, E}, units.head);
  }
  for (ParameterView& view : views) view.tp = kParallelModules.placement(view.name);
  models::require_addressable(views, {{"vocab_size", c.vocab_size},
                                      {"n_positions", c.n_positions},
                                      {"n_embd", E},
                                      {"n_inner", c.n_inner}});
  return views;
}

void init_parameter(const Gpt2Config& config, const std::vector<ParameterView>& parameters,
                    uint64_t seed, int64_t index, float* values) {
  const ParameterView& view = parameters.at(size_t(index));
  if (view.shape.size() == 1) {
    std::fill_n(values, view.numel, ends_with(view.name, ".weight") ? 1.0f : 0.0f);
    return;
  }
  // GPT-2's scaling of the projections into the residual stream, which n_layer
  // layers' worth add up.
  const double scale =
      ends_with(view.name, "c_proj.weight") ? 1.0 / std::sqrt(2.0 * double(config.n_layer)) : 1.0;
  models::init_normal(parameters, seed, index, config.initializer_range * scale, values);
}

}  // namespace meshrun::gpt2
