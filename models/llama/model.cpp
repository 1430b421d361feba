#include "llama/model.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numbers>
#include <stdexcept>
#include <utility>

#include "llama/layers.hpp"
#include "tensor/elements.hpp"

namespace meshrun::llama {

namespace {

void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument("llama: " + message);
}

void check_config(const LlamaConfig& c) {
  require(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 &&
              c.num_hidden_layers > 0 && c.num_attention_heads > 0 && c.num_key_value_heads > 0,
          "vocab_size, hidden_size, intermediate_size, num_hidden_layers, "
          "num_attention_heads and num_key_value_heads must be positive");
  require(c.hidden_size % c.num_attention_heads == 0,
          "hidden_size must be divisible by num_attention_heads");
  require(c.num_attention_heads % c.num_key_value_heads == 0,
          "num_attention_heads must be divisible by num_key_value_heads");
  require((c.hidden_size / c.num_attention_heads) % 2 == 0,
          "the head dimension hidden_size / num_attention_heads must be even for rotary "
          "embeddings");
}

void check_tokens(const int32_t* tokens, int64_t count, int64_t vocab_size, const char* what) {
  for (int64_t i = 0; i < count; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size) {
      throw std::out_of_range("llama: " + std::string(what) + "[" + std::to_string(i) +
                              "] = " + std::to_string(tokens[i]) + " is outside [0, vocab_size " +
                              std::to_string(vocab_size) + ")");
    }
  }
}

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

// Everything forward keeps for backward, and backward's scratch, for one
// (batch, seq_len) shape. N = batch * seq_len rows throughout.
struct LlamaModel::Activations {
  // What one decoder layer keeps.
  struct Layer {
    std::vector<float> norm1, rstd1;  // rmsnorm(x) [N, H], its 1/rms [N]
    std::vector<float> qkv;           // after rotary [N, q+2kv]
    std::vector<float> probs;         // [batch, heads, T, T]
    std::vector<float> attention;     // attention output [N, q]
    std::vector<float> h;             // x + o_proj(attention) [N, H]
    std::vector<float> norm2, rstd2;  // rmsnorm(h) [N, H], [N]
    std::vector<float> gate_up;       // [N, 2I]
    std::vector<float> mlp;           // silu(gate) * up [N, I]
  };

  Activations(const LlamaConfig& c, int64_t head_dim, int64_t batch, int64_t seq_len)
      : shape{batch, seq_len, c.num_attention_heads, c.num_key_value_heads, head_dim},
        hidden(c.hidden_size),
        rotary(head_dim, seq_len, c.rope_theta),
        tokens(rows()),
        targets(rows()),
        residual((c.num_hidden_layers + 1) * rows() * c.hidden_size),
        layers(c.num_hidden_layers),
        final_norm(rows() * c.hidden_size),
        final_rstd(rows()),
        logits(rows() * c.vocab_size),
        projection(rows() * c.hidden_size),
        d_residual(rows() * c.hidden_size),
        d_norm(rows() * c.hidden_size),
        d_qkv(rows() * shape.qkv_dim()),
        d_attention(rows() * shape.q_dim()),
        d_scores(shape.d_scores_size()),
        d_gate_up(rows() * 2 * c.intermediate_size),
        d_mlp(rows() * c.intermediate_size) {
    const int64_t n = rows(), inter = c.intermediate_size;
    for (Layer& layer : layers) {
      layer.norm1.resize(n * hidden);
      layer.rstd1.resize(n);
      layer.qkv.resize(n * shape.qkv_dim());
      layer.probs.resize(batch * shape.heads * seq_len * seq_len);
      layer.attention.resize(n * shape.q_dim());
      layer.h.resize(n * hidden);
      layer.norm2.resize(n * hidden);
      layer.rstd2.resize(n);
      layer.gate_up.resize(n * 2 * inter);
      layer.mlp.resize(n * inter);
    }
  }

  int64_t rows() const { return shape.batch * shape.seq_len; }
  // The input of decoder layer `layer`; at num_hidden_layers, the final norm's.
  float* residual_at(int64_t layer) { return residual.data() + layer * rows() * hidden; }

  AttentionShape shape;
  int64_t hidden;
  RotaryTable<float> rotary;
  std::vector<int32_t> tokens, targets;
  std::vector<float> residual;
  std::vector<Layer> layers;
  std::vector<float> final_norm, final_rstd;
  std::vector<float> logits;      // softmax after forward, dL/dlogits in backward
  std::vector<float> projection;  // o_proj / down_proj output before its residual add
  // Backward scratch, reused by every layer.
  std::vector<float> d_residual, d_norm, d_qkv, d_attention, d_scores, d_gate_up, d_mlp;
  bool ready_for_backward = false;
};

LlamaModel::LlamaModel(LlamaConfig config) : config_(config), hooks_(&no_hooks()) {
  check_config(config_);
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) openblas_set_num_threads(1);
  const int64_t H = config_.hidden_size, I = config_.intermediate_size;
  const int64_t V = config_.vocab_size;
  head_dim_ = H / config_.num_attention_heads;
  const int64_t q_dim = config_.num_attention_heads * head_dim_;
  const int64_t kv_dim = config_.num_key_value_heads * head_dim_;

  add_parameter("model.embed_tokens.weight", {V, H});  // kEmbedIndex
  for (int64_t n = 0; n < config_.num_hidden_layers; ++n) {
    const std::string prefix = "model.layers." + std::to_string(n) + ".";  // in LayerTensor order
    add_parameter(prefix + "input_layernorm.weight", {H});
    add_parameter(prefix + "self_attn.q_proj.weight", {q_dim, H});
    add_parameter(prefix + "self_attn.k_proj.weight", {kv_dim, H});
    add_parameter(prefix + "self_attn.v_proj.weight", {kv_dim, H});
    add_parameter(prefix + "self_attn.o_proj.weight", {H, q_dim});
    add_parameter(prefix + "post_attention_layernorm.weight", {H});
    add_parameter(prefix + "mlp.gate_proj.weight", {I, H});
    add_parameter(prefix + "mlp.up_proj.weight", {I, H});
    add_parameter(prefix + "mlp.down_proj.weight", {H, I});
  }
  norm_index_ = int(parameters_.size());
  add_parameter("model.norm.weight", {H});
  if (!config_.tie_word_embeddings) {
    lm_head_index_ = int(parameters_.size());
    add_parameter("lm_head.weight", {V, H});
  }

  num_parameters_ = int64_t(params_.size());
  grads_.assign(params_.size(), 0.0f);
  int64_t offset = 0;
  for (ParameterView& view : parameters_) {
    view.data = params_.data() + offset;
    view.grad = grads_.data() + offset;
    offset += view.numel;
  }
  init_weights(0);
}

LlamaModel::~LlamaModel() = default;
LlamaModel::LlamaModel(LlamaModel&&) noexcept = default;
LlamaModel& LlamaModel::operator=(LlamaModel&&) noexcept = default;

// Grows the parameter buffer; views get their pointers once it is complete.
void LlamaModel::add_parameter(std::string name, std::vector<int64_t> shape) {
  int64_t numel = 1;
  for (int64_t size : shape) numel *= size;
  params_.resize(params_.size() + numel);
  parameters_.push_back({std::move(name), std::move(shape), nullptr, nullptr, numel});
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

void LlamaModel::release_storage() {
  std::vector<float>().swap(params_);
  std::vector<float>().swap(grads_);
  for (ParameterView& view : parameters_) view.data = view.grad = nullptr;
}

float* LlamaModel::hidden_states(int64_t layer) {
  require(layer >= 0 && layer <= config_.num_hidden_layers, "hidden_states: layer out of range");
  return acts_ ? acts_->residual_at(layer) : nullptr;
}

int64_t LlamaModel::hidden_states_numel() const {
  return acts_ ? acts_->rows() * config_.hidden_size : 0;
}

void LlamaModel::set_hooks(ModuleHooks* hooks) { hooks_ = hooks ? hooks : &no_hooks(); }

float LlamaModel::forward(const int32_t* tokens, const int32_t* targets, int64_t batch,
                          int64_t seq_len) {
  require(batch > 0 && seq_len > 0, "forward needs batch > 0 and seq_len > 0");
  check_tokens(tokens, batch * seq_len, config_.vocab_size, "tokens");
  check_tokens(targets, batch * seq_len, config_.vocab_size, "targets");
  if (!acts_ || acts_->shape.batch != batch || acts_->shape.seq_len != seq_len) {
    acts_.reset();  // the old shape's buffers go before the new ones come
    acts_ = std::make_unique<Activations>(config_, head_dim_, batch, seq_len);
  }
  Activations& a = *acts_;
  const int64_t N = a.rows(), H = config_.hidden_size, V = config_.vocab_size;
  const int64_t L = config_.num_hidden_layers;
  const ParameterView& embed = parameters_[kEmbedIndex];
  const ParameterView& norm = parameters_[norm_index_];
  const ParameterView& lm_head = parameters_[lm_head_index_];
  std::copy_n(tokens, N, a.tokens.begin());
  std::copy_n(targets, N, a.targets.begin());

  hooks_->pre_forward(kRootUnit);
  embedding_forward(a.residual_at(0), a.tokens.data(), embed.data, N, H);
  for (int64_t layer = 0; layer < L; ++layer) {
    hooks_->pre_forward(int(layer));
    layer_forward(layer);
    hooks_->post_forward(int(layer));
  }
  rmsnorm_forward(a.final_norm.data(), a.final_rstd.data(), a.residual_at(L), norm.data, N, H,
                  config_.rms_norm_eps);
  linear_forward(a.logits.data(), a.final_norm.data(), lm_head.data, N, H, V);
  const double loss = cross_entropy_forward(a.logits.data(), a.targets.data(), N, V);
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
  const int64_t N = a.rows(), H = config_.hidden_size, V = config_.vocab_size;
  const int64_t L = config_.num_hidden_layers;
  const ParameterView& embed = parameters_[kEmbedIndex];
  const ParameterView& norm = parameters_[norm_index_];
  const ParameterView& lm_head = parameters_[lm_head_index_];

  hooks_->pre_backward(kRootUnit);
  cross_entropy_backward(a.logits.data(), a.targets.data(), N, V);
  linear_backward(a.d_norm.data(), lm_head.grad, a.logits.data(), a.final_norm.data(), lm_head.data,
                  N, H, V);
  if (lm_head_index_ != kEmbedIndex) hooks_->gradient_ready(lm_head_index_);
  std::fill(a.d_residual.begin(), a.d_residual.end(), 0.0f);
  rmsnorm_backward(a.d_residual.data(), norm.grad, a.d_norm.data(), a.residual_at(L), norm.data,
                   a.final_rstd.data(), N, H);
  hooks_->gradient_ready(norm_index_);
  for (int64_t layer = L - 1; layer >= 0; --layer) {
    hooks_->pre_backward(int(layer));
    layer_backward(layer);
    hooks_->post_backward(int(layer));
  }
  embedding_backward(embed.grad, a.tokens.data(), a.d_residual.data(), N, H);
  hooks_->gradient_ready(kEmbedIndex);
  hooks_->post_backward(kRootUnit);
}

void LlamaModel::layer_gradients_ready(int64_t layer, LayerTensor first, LayerTensor last) {
  const int base = int(kEmbedIndex + 1 + layer * kTensorsPerLayer);
  for (int tensor = last; tensor >= first; --tensor) hooks_->gradient_ready(base + tensor);
}

// h = x + o_proj(attention(rotary(qkv_proj(rmsnorm(x)))))
// out = h + down_proj(swiglu(gate_up_proj(rmsnorm(h))))
void LlamaModel::layer_forward(int64_t layer) {
  Activations& a = *acts_;
  Activations::Layer& saved = a.layers[layer];
  const AttentionShape& shape = a.shape;
  const int64_t N = a.rows(), H = config_.hidden_size, I = config_.intermediate_size;
  const float* x = a.residual_at(layer);

  rmsnorm_forward(saved.norm1.data(), saved.rstd1.data(), x, layer_tensor(layer, kInputNorm).data,
                  N, H, config_.rms_norm_eps);
  linear_forward(saved.qkv.data(), saved.norm1.data(), layer_tensor(layer, kQ).data, N, H,
                 shape.qkv_dim());
  rotary_forward(saved.qkv.data(), a.rotary, shape.batch, shape.seq_len,
                 shape.heads + shape.kv_heads, shape.qkv_dim());
  attention_forward(saved.attention.data(), saved.probs.data(), saved.qkv.data(), shape);
  linear_forward(a.projection.data(), saved.attention.data(), layer_tensor(layer, kO).data, N,
                 shape.q_dim(), H);
  residual_forward(saved.h.data(), x, a.projection.data(), N * H);

  rmsnorm_forward(saved.norm2.data(), saved.rstd2.data(), saved.h.data(),
                  layer_tensor(layer, kPostNorm).data, N, H, config_.rms_norm_eps);
  linear_forward(saved.gate_up.data(), saved.norm2.data(), layer_tensor(layer, kGate).data, N, H,
                 2 * I);
  swiglu_forward(saved.mlp.data(), saved.gate_up.data(), N, I);
  linear_forward(a.projection.data(), saved.mlp.data(), layer_tensor(layer, kDown).data, N, I, H);
  residual_forward(a.residual_at(layer + 1), saved.h.data(), a.projection.data(), N * H);
}

// On entry d_residual holds dL/d(out); on exit dL/dx. Each residual add
// passes its gradient through, so the norms' backward accumulates into it.
void LlamaModel::layer_backward(int64_t layer) {
  Activations& a = *acts_;
  const Activations::Layer& saved = a.layers[layer];
  const AttentionShape& shape = a.shape;
  const int64_t N = a.rows(), H = config_.hidden_size, I = config_.intermediate_size;
  float* d_residual = a.d_residual.data();
  const ParameterView& input_norm = layer_tensor(layer, kInputNorm);
  const ParameterView& qkv = layer_tensor(layer, kQ);
  const ParameterView& o = layer_tensor(layer, kO);
  const ParameterView& post_norm = layer_tensor(layer, kPostNorm);
  const ParameterView& gate_up = layer_tensor(layer, kGate);
  const ParameterView& down = layer_tensor(layer, kDown);

  linear_backward(a.d_mlp.data(), down.grad, d_residual, saved.mlp.data(), down.data, N, I, H);
  layer_gradients_ready(layer, kDown, kDown);
  swiglu_backward(a.d_gate_up.data(), a.d_mlp.data(), saved.gate_up.data(), N, I);
  linear_backward(a.d_norm.data(), gate_up.grad, a.d_gate_up.data(), saved.norm2.data(),
                  gate_up.data, N, H, 2 * I);
  layer_gradients_ready(layer, kGate, kUp);
  rmsnorm_backward(d_residual, post_norm.grad, a.d_norm.data(), saved.h.data(), post_norm.data,
                   saved.rstd2.data(), N, H);
  layer_gradients_ready(layer, kPostNorm, kPostNorm);

  linear_backward(a.d_attention.data(), o.grad, d_residual, saved.attention.data(), o.data, N,
                  shape.q_dim(), H);
  layer_gradients_ready(layer, kO, kO);
  attention_backward(a.d_qkv.data(), a.d_scores.data(), a.d_attention.data(), saved.qkv.data(),
                     saved.probs.data(), shape);
  rotary_backward(a.d_qkv.data(), a.rotary, shape.batch, shape.seq_len,
                  shape.heads + shape.kv_heads, shape.qkv_dim());
  linear_backward(a.d_norm.data(), qkv.grad, a.d_qkv.data(), saved.norm1.data(), qkv.data, N, H,
                  shape.qkv_dim());
  layer_gradients_ready(layer, kQ, kV);
  rmsnorm_backward(d_residual, input_norm.grad, a.d_norm.data(), a.residual_at(layer),
                   input_norm.data, saved.rstd1.data(), N, H);
  layer_gradients_ready(layer, kInputNorm, kInputNorm);
}

void round_to_bfloat16(float* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i) values[i] = bfloat16_to_float(float_to_bfloat16(values[i]));
}

}  // namespace meshrun::llama
