#include "mixtral/model.hpp"

#include <stdexcept>

namespace meshrun::mixtral {

using models::add_parameter;
using models::DecoderUnits;

void check_config(const MixtralConfig& c) {
  llama::check_config(c);
  if (c.num_experts_per_tok > c.num_local_experts) {
    throw std::invalid_argument(
        "model.num_experts_per_tok: " + std::to_string(c.num_experts_per_tok) +
        " experts per token cannot be more than model.num_local_experts (" +
        std::to_string(c.num_local_experts) + ")");
  }
}

const std::vector<const char*>& config_keys() {
  static const std::vector<const char*> keys = [] {
    std::vector<const char*> all;
    for (const char* const* key = llama::kDecoderConfigKeys; *key != nullptr; ++key) {
      all.push_back(*key);
    }
    all.insert(all.end(),
               {"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", nullptr});
    return all;
  }();
  return keys;
}

MixtralConfig read_config(const models::ConfigReader& reader) {
  llama::LlamaConfig decoder;
  decoder.intermediate_size = 512;
  decoder.rope_theta = 1e6;
  MixtralConfig c;
  static_cast<llama::LlamaConfig&>(c) = llama::read_decoder_config(reader, decoder);
  c.num_local_experts = reader.integer("num_local_experts", c.num_local_experts, 1, 4096);
  c.num_experts_per_tok = reader.integer("num_experts_per_tok", c.num_experts_per_tok);
  c.router_aux_loss_coef =
      reader.non_negative_number("router_aux_loss_coef", c.router_aux_loss_coef);
  check_config(c);
  return c;
}

nlohmann::ordered_json hf_config(const MixtralConfig& c) {
  const llama::LlamaConfig& d = c;
  return {{"architectures", {"MixtralForCausalLM"}},
          {"model_type", "mixtral"},
          {"vocab_size", d.vocab_size},
          {"hidden_size", d.hidden_size},
          {"intermediate_size", d.intermediate_size},
          {"num_hidden_layers", d.num_hidden_layers},
          {"num_attention_heads", d.num_attention_heads},
          {"num_key_value_heads", d.num_key_value_heads},
          {"head_dim", d.hidden_size / d.num_attention_heads},
          {"hidden_act", "silu"},
          {"max_position_embeddings", d.max_position_embeddings},
          {"rms_norm_eps", d.rms_norm_eps},
          {"rope_theta", d.rope_theta},
          {"tie_word_embeddings", d.tie_word_embeddings},
          {"num_local_experts", c.num_local_experts},
          {"num_experts_per_tok", c.num_experts_per_tok},
          {"router_aux_loss_coef", c.router_aux_loss_coef},
          {"output_router_logits", false},
          {"router_jitter_noise", 0.0},
          {"sliding_window", nullptr}};
}

std::vector<ParameterView> model_parameters(const MixtralConfig& config) {
  const llama::LlamaConfig& d = config;
  const int64_t H = d.hidden_size, I = d.intermediate_size, E = config.num_local_experts;
  const DecoderUnits units(d.num_hidden_layers);
  std::vector<ParameterView> views;
  add_parameter(views, "model.embed_tokens.weight", {d.vocab_size, H},
                units.token_embedding(d.tie_word_embeddings));
  for (int64_t layer = 0; layer < d.num_hidden_layers; ++layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".";
    llama::add_attention_parameters(views, d, layer);
    add_parameter(views, prefix + "block_sparse_moe.gate.weight", {E, H}, layer);
    for (int64_t expert = 0; expert < E; ++expert) {
      const std::string name = prefix + "block_sparse_moe.experts." + std::to_string(expert) + ".";
      add_parameter(views, name + "w1.weight", {I, H}, layer);
      add_parameter(views, name + "w3.weight", {I, H}, layer);
      add_parameter(views, name + "w2.weight", {H, I}, layer);
      for (int k = 1; k <= 3; ++k) views[views.size() - size_t(k)].expert = expert;
    }
  }
  add_parameter(views, "model.norm.weight", {H}, units.head);
  if (!d.tie_word_embeddings) add_parameter(views, "lm_head.weight", {d.vocab_size, H}, units.head);
  models::require_addressable(views, {{"vocab_size", d.vocab_size},
                                      {"hidden_size", H},
                                      {"intermediate_size", I},
                                      {"num_local_experts", E}});
  return views;
}

void init_parameter(const std::vector<ParameterView>& parameters, uint64_t seed, int64_t index,
                    float* values) {
  llama::init_parameter(parameters, seed, index, values);
}

}  // namespace meshrun::mixtral
