#include "llama/model.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>
#include <utility>

namespace meshrun::llama {

namespace {

// splitmix64 (Steele, Lea, Flood 2014): fully specified, unlike the
// distributions of <random>, so a seed means the same weights everywhere.
// Its state advances by a constant per draw, so `skip` jumps ahead at once.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  void skip(uint64_t draws) { state_ += draws * kGamma; }
  uint64_t next() {
    uint64_t z = (state_ += kGamma);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1]: the top 53 bits, shifted off zero so log() is finite.
  double uniform() { return (double(next() >> 11) + 1.0) * 0x1.0p-53; }

 private:
  static constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;
  uint64_t state_;
};

// Box-Muller: sqrt(-2 ln u1) cos(2 pi u2) is standard normal.
double standard_normal(SplitMix64& generator) {
  const double radius = std::sqrt(-2.0 * std::log(generator.uniform()));
  return radius * std::cos(2.0 * std::numbers::pi * generator.uniform());
}

bool is_norm(const ParameterView& view) { return view.shape.size() == 1; }

void add(std::vector<ParameterView>& views, std::string name, std::vector<int64_t> shape,
         int64_t unit) {
  int64_t numel = 1;
  for (int64_t size : shape) numel *= size;
  const auto index = int64_t(views.size());
  views.push_back({std::move(name), std::move(shape), numel, index, unit, nullptr, nullptr});
}

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

std::vector<ParameterView> model_parameters(const LlamaConfig& config) {
  const int64_t H = config.hidden_size, I = config.intermediate_size;
  const int64_t head_dim = H / config.num_attention_heads;
  const int64_t q_dim = config.num_attention_heads * head_dim;
  const int64_t kv_dim = config.num_key_value_heads * head_dim;
  const int64_t root = root_unit(config);
  std::vector<ParameterView> views;
  add(views, "model.embed_tokens.weight", {config.vocab_size, H}, root);
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".";
    add(views, prefix + "input_layernorm.weight", {H}, layer);
    add(views, prefix + "self_attn.q_proj.weight", {q_dim, H}, layer);
    add(views, prefix + "self_attn.k_proj.weight", {kv_dim, H}, layer);
    add(views, prefix + "self_attn.v_proj.weight", {kv_dim, H}, layer);
    add(views, prefix + "self_attn.o_proj.weight", {H, q_dim}, layer);
    add(views, prefix + "post_attention_layernorm.weight", {H}, layer);
    add(views, prefix + "mlp.gate_proj.weight", {I, H}, layer);
    add(views, prefix + "mlp.up_proj.weight", {I, H}, layer);
    add(views, prefix + "mlp.down_proj.weight", {H, I}, layer);
  }
  add(views, "model.norm.weight", {H}, root);
  if (!config.tie_word_embeddings) add(views, "lm_head.weight", {config.vocab_size, H}, root);
  return views;
}

void init_parameter(const std::vector<ParameterView>& parameters, uint64_t seed, int64_t index,
                    float* values) {
  const ParameterView& view = parameters.at(size_t(index));
  if (is_norm(view)) {
    std::fill_n(values, view.numel, 1.0f);
    return;
  }
  // Two uniform draws per element of every matrix before this one.
  uint64_t draws = 0;
  for (int64_t p = 0; p < index; ++p) {
    if (!is_norm(parameters[size_t(p)])) draws += 2 * uint64_t(parameters[size_t(p)].numel);
  }
  SplitMix64 generator(seed);
  generator.skip(draws);
  for (int64_t i = 0; i < view.numel; ++i) values[i] = float(0.02 * standard_normal(generator));
}

}  // namespace meshrun::llama
