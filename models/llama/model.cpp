#include "llama/model.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>
#include <utility>

#include "llama/decoder.hpp"
#include "tensor/elements.hpp"

namespace meshrun::llama {

namespace {

// splitmix64 (Steele, Lea, Flood 2014): fully specified, unlike the
// distributions of <random>, so a seed means the same weights everywhere.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1]: the top 53 bits, shifted off zero so log() is finite.
  double uniform() { return (double(next() >> 11) + 1.0) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

// Box-Muller: sqrt(-2 ln u1) cos(2 pi u2) is standard normal.
double standard_normal(SplitMix64& generator) {
  const double radius = std::sqrt(-2.0 * std::log(generator.uniform()));
  return radius * std::cos(2.0 * std::numbers::pi * generator.uniform());
}

ModuleHooks& no_hooks() {
  static ModuleHooks none;
  return none;
}

}  // namespace

// Everything forward keeps for backward, and the pass's scratch, for one
// (batch, seq_len) shape.
struct LlamaModel::Activations {
  Activations(const LlamaConfig& c, int64_t batch, int64_t seq_len)
      : pass(c, batch, seq_len),
        tokens(pass.rows()),
        targets(pass.rows()),
        residual((c.num_hidden_layers + 1) * pass.rows() * c.hidden_size),
        layers(c.num_hidden_layers, LayerActivations(pass)),
        head(pass) {}

  // The input of decoder layer `layer`; at num_hidden_layers, the final norm's.
  float* residual_at(int64_t layer) { return residual.data() + layer * pass.rows() * pass.hidden; }

  DecoderPass pass;
  std::vector<int32_t> tokens, targets;
  std::vector<float> residual;
  std::vector<LayerActivations> layers;
  HeadActivations head;
  bool ready_for_backward = false;
};

// Computes the weight gradients at once and announces each to the hooks;
// the embedding's (which a tied lm_head shares) waits for the embedding's
// own backward.
class LlamaModel::HookedGradients : public ImmediateWeightGradients {
 public:
  explicit HookedGradients(LlamaModel& model) : model_(model) {}

 private:
  void ready(const ParameterView& view) override {
    const int index = int(&view - model_.parameters_.data());
    if (index != kEmbedIndex) model_.hooks_->gradient_ready(index);
  }
  LlamaModel& model_;
};

LlamaModel::LlamaModel(LlamaConfig config) : config_(config), hooks_(&no_hooks()) {
  check_config(config_);
  use_one_blas_thread_by_default();
  add_embedding_parameters(parameters_, config_);  // kEmbedIndex
  for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer) {
    add_layer_parameters(parameters_, config_, layer);
  }
  norm_index_ = int(parameters_.size());
  add_head_parameters(parameters_, config_);
  if (!config_.tie_word_embeddings) lm_head_index_ = norm_index_ + 1;
  bind_parameters(parameters_, params_, grads_);
  num_parameters_ = int64_t(params_.size());
  init_weights(0);
}

LlamaModel::~LlamaModel() = default;
LlamaModel::LlamaModel(LlamaModel&&) noexcept = default;
LlamaModel& LlamaModel::operator=(LlamaModel&&) noexcept = default;

const ParameterView* LlamaModel::layer_views(int64_t layer) const {
  return &parameters_[kEmbedIndex + 1 + layer * kTensorsPerLayer];
}

void LlamaModel::init_weights(uint64_t seed) {
  SplitMix64 generator(seed);
  for (ParameterView& view : parameters_) {
    const bool is_norm = view.shape.size() == 1;
    for (int64_t i = 0; i < view.numel; ++i) {
      view.data[i] = is_norm ? 1.0f : float(0.02 * standard_normal(generator));
    }
  }
}

void LlamaModel::zero_grad() { std::fill(grads_.begin(), grads_.end(), 0.0f); }

void LlamaModel::release_storage() { release_parameters(parameters_, params_, grads_); }

float* LlamaModel::hidden_states(int64_t layer) {
  require(layer >= 0 && layer <= config_.num_hidden_layers, "hidden_states: layer out of range");
  return acts_ ? acts_->residual_at(layer) : nullptr;
}

int64_t LlamaModel::hidden_states_numel() const {
  return acts_ ? acts_->pass.rows() * config_.hidden_size : 0;
}

void LlamaModel::set_hooks(ModuleHooks* hooks) { hooks_ = hooks ? hooks : &no_hooks(); }

float LlamaModel::forward(const int32_t* tokens, const int32_t* targets, int64_t batch,
                          int64_t seq_len) {
  require(batch > 0 && seq_len > 0, "forward needs batch > 0 and seq_len > 0");
  check_tokens(tokens, batch * seq_len, config_.vocab_size, "tokens");
  check_tokens(targets, batch * seq_len, config_.vocab_size, "targets");
  if (!acts_ || acts_->pass.attention.batch != batch || acts_->pass.attention.seq_len != seq_len) {
    acts_.reset();  // the old shape's buffers go before the new ones come
    acts_ = std::make_unique<Activations>(config_, batch, seq_len);
  }
  Activations& a = *acts_;
  const int64_t N = a.pass.rows(), L = config_.num_hidden_layers;
  std::copy_n(tokens, N, a.tokens.begin());
  std::copy_n(targets, N, a.targets.begin());

  hooks_->pre_forward(kRootUnit);
  embedding_forward(a.residual_at(0), a.tokens.data(), parameters_[kEmbedIndex].data, N,
                    config_.hidden_size);
  for (int64_t layer = 0; layer < L; ++layer) {
    hooks_->pre_forward(int(layer));
    layer_forward(a.pass, layer_views(layer), a.residual_at(layer), a.layers[layer],
                  a.residual_at(layer + 1));
    hooks_->post_forward(int(layer));
  }
  const double loss = head_forward(a.pass, parameters_[norm_index_], parameters_[lm_head_index_],
                                   a.residual_at(L), a.targets.data(), a.head);
  hooks_->post_forward(kRootUnit);
  a.ready_for_backward = true;
  return float(loss);
}

void LlamaModel::backward() {
  if (!acts_ || !acts_->ready_for_backward) {
    throw std::logic_error("llama: backward() needs a forward() since the last backward()");
  }
  Activations& a = *acts_;
  a.ready_for_backward = false;
  const int64_t L = config_.num_hidden_layers;
  HookedGradients gradients(*this);

  hooks_->pre_backward(kRootUnit);
  head_backward(a.pass, parameters_[norm_index_], parameters_[lm_head_index_], a.residual_at(L),
                a.targets.data(), 1.0f, a.head, gradients);
  for (int64_t layer = L - 1; layer >= 0; --layer) {
    hooks_->pre_backward(int(layer));
    layer_backward(a.pass, layer_views(layer), a.residual_at(layer), a.layers[layer], gradients);
    hooks_->post_backward(int(layer));
  }
  embedding_backward(parameters_[kEmbedIndex].grad, a.tokens.data(), a.pass.d_residual.data(),
                     a.pass.rows(), config_.hidden_size);
  hooks_->gradient_ready(kEmbedIndex);
  hooks_->post_backward(kRootUnit);
}

void round_to_bfloat16(float* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i) values[i] = bfloat16_to_float(float_to_bfloat16(values[i]));
}

}  // namespace meshrun::llama
