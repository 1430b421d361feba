#include "llama/stage.hpp"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "llama/decoder.hpp"

namespace meshrun::llama {

namespace {

// A linear's weight gradient that backward_input left for backward_weight:
// dW += dy^T x, over the rows of one microbatch, for the adjacent views
// [first, first + views).
struct PendingLinear {
  ParameterView* first;
  int64_t views;
  std::vector<float> dy, x;
  int64_t rows, in, out;
};

std::string microbatch_name(int32_t mb) { return "llama stage: microbatch " + std::to_string(mb); }

// Keeps each linear's dy and x for the weight pass; the norms' gradients
// are final at once.
class DeferredWeightGradients : public WeightGradients {
 public:
  DeferredWeightGradients(std::vector<PendingLinear>& pending, StageHooks& hooks)
      : pending_(pending), hooks_(hooks) {}
  void linear(const ParameterView* first, const ParameterView* last, const float* dy,
              std::vector<float>& x, int64_t rows, int64_t in, int64_t out) override {
    pending_.push_back({const_cast<ParameterView*>(first), last - first + 1,
                        std::vector<float>(dy, dy + rows * out), std::move(x), rows, in, out});
  }
  void norm_ready(const ParameterView& view) override { hooks_.gradient_ready(view.index); }

 private:
  std::vector<PendingLinear>& pending_;
  StageHooks& hooks_;
};

// q, k, v and gate, up act as one fused projection each: the host lays a
// unit's parameters out one after another (meshrun/model.h).
void require_fused(const ParameterView* layer, bool backward) {
  const auto adjacent = [&](LayerTensor first, LayerTensor last) {
    for (int t = first; t < last; ++t) {
      if (layer[t].data + layer[t].numel != layer[t + 1].data ||
          (backward && layer[t].grad + layer[t].numel != layer[t + 1].grad)) {
        return false;
      }
    }
    return true;
  };
  if (!adjacent(kQ, kV) || !adjacent(kGate, kUp)) {
    throw std::invalid_argument("llama: the host gave " +
                                layer[kQ].name.substr(0, layer[kQ].name.rfind(".self_attn")) +
                                " storage that is not one block in parameter order");
  }
}

}  // namespace

// Computes the weight gradients at once and announces each to the hooks;
// the embedding's (which a tied lm_head shares) waits for the embedding's
// own backward.
class LlamaStage::AnnouncedGradients : public ImmediateWeightGradients {
 public:
  explicit AnnouncedGradients(LlamaStage& stage) : stage_(stage) {}

 private:
  void ready(const ParameterView& view) override {
    if (int(&view - stage_.parameters_.data()) != stage_.embed_index_) {
      stage_.hooks_.gradient_ready(view.index);
    }
  }
  LlamaStage& stage_;
};

// One microbatch in flight: what its forward kept (until its backward, or
// its backward_input), then what backward_input kept for backward_weight.
struct LlamaStage::Microbatch {
  // The forward's state. residual holds the stage's input and each layer's
  // output that a backward reads: with L layers, slots 0..L-1 (the layers'
  // inputs) and, with the head, slot L (the final norm's input). Without
  // the head the last output goes straight to the caller's buffer.
  struct Saved {
    Saved(const DecoderPass& pass, const StageLayout& layout)
        : tokens(layout.embedding ? pass.rows() : 0),
          targets(layout.head ? pass.rows() : 0),
          residual((layout.end_layer - layout.first_layer + (layout.head ? 1 : 0)) * pass.rows() *
                   pass.hidden),
          layers(layout.end_layer - layout.first_layer, LayerActivations(pass)),
          hidden(pass.rows() * pass.hidden) {
      if (layout.head) head.emplace(pass);
    }
    int64_t bytes() const {
      int64_t total = bytes_of(tokens, targets, residual);
      for (const LayerActivations& layer : layers) total += layer.bytes();
      return total + (head ? head->bytes() : 0);
    }
    // Residual slot `slot`, else (one past the last) the caller's output.
    float* stream(int64_t slot, float* output) {
      return slot * hidden < int64_t(residual.size()) ? residual.data() + slot * hidden : output;
    }

    std::vector<int32_t> tokens, targets;
    std::vector<float> residual;
    std::vector<LayerActivations> layers;
    std::optional<HeadActivations> head;
    int64_t hidden;  // elements of one slot
  };

  int64_t bytes() const {
    int64_t total = saved ? saved->bytes() : 0;
    for (const PendingLinear& linear : pending) total += bytes_of(linear.dy, linear.x);
    return total;
  }

  std::unique_ptr<Saved> saved;  // null once backward_input has run
  std::vector<PendingLinear> pending;
};

LlamaStage::LlamaStage(LlamaConfig config, StageLayout layout, StageHooks& hooks)
    : config_(config), layout_(layout), hooks_(hooks) {
  check_config(config_);
  const int64_t L = config_.num_hidden_layers;
  require(0 <= layout_.first_layer && layout_.first_layer <= layout_.end_layer &&
              layout_.end_layer <= L,
          "stage layers [" + std::to_string(layout_.first_layer) + ", " +
              std::to_string(layout_.end_layer) + ") are not within the model's [0, " +
              std::to_string(L) + ")");
  require(!layout_.embedding || layout_.first_layer == 0,
          "the embedding goes on the stage of layer 0, not one starting at layer " +
              std::to_string(layout_.first_layer));
  require(!layout_.head || layout_.end_layer == L,
          "the head (final norm, lm_head, loss) goes on the stage of the last layer, not one "
          "ending before layer " +
              std::to_string(layout_.end_layer));
  require(layer_count() > 0 || holds_root(),
          "a stage holds at least a layer, the embedding or the head");
  require(!config_.tie_word_embeddings || (layout_.embedding && layout_.head),
          "tie_word_embeddings needs the embedding and lm_head on one stage: tied embeddings "
          "cannot be split across pipeline stages");
  use_one_blas_thread_by_default();

  for (ParameterView& view : model_parameters(config_)) {
    const bool in_layers = view.unit >= layout_.first_layer && view.unit < layout_.end_layer;
    const bool is_embedding = view.name == "model.embed_tokens.weight";
    const bool in_head = view.unit == root_unit(config_) && !is_embedding;
    if (in_layers || (is_embedding && layout_.embedding) || (in_head && layout_.head)) {
      if (is_embedding) embed_index_ = int(parameters_.size());
      if (view.name == "model.norm.weight") norm_index_ = int(parameters_.size());
      parameters_.push_back(std::move(view));
    }
  }
  lm_head_index_ = config_.tie_word_embeddings ? embed_index_ : norm_index_ + 1;
}

LlamaStage::~LlamaStage() = default;

ParameterView* LlamaStage::layer_views(int64_t layer) {
  const int64_t first = layout_.embedding ? 1 : 0;
  return &parameters_[size_t(first + (layer - layout_.first_layer) * kTensorsPerLayer)];
}

void LlamaStage::enter(int64_t unit, float* hidden, bool backward) {
  if (backward) {
    hooks_.pre_backward(unit);
  } else {
    hooks_.pre_forward(unit, hidden, hidden != nullptr ? pass_->rows() * pass_->hidden : 0);
  }
  for (ParameterView& view : parameters_) {
    if (view.unit == unit) hooks_.bind(view, backward);
  }
  if (unit != root_unit(config_)) require_fused(layer_views(unit), backward);
}

void LlamaStage::set_shape(int64_t batch, int64_t seq_len) {
  require(batch > 0 && seq_len > 0, "stage set_shape needs batch > 0 and seq_len > 0");
  if (pass_ && pass_->attention.batch == batch && pass_->attention.seq_len == seq_len) return;
  if (!microbatches_.empty()) {
    throw std::logic_error("llama stage: set_shape while " + std::to_string(microbatches_.size()) +
                           " microbatches are in flight; finish their backward first");
  }
  pass_.reset();  // the old shape's scratch goes before the new one comes
  pass_ = std::make_unique<DecoderPass>(config_, batch, seq_len);
}

int64_t LlamaStage::input_numel() const {
  return pass_ && !layout_.embedding ? pass_->rows() * config_.hidden_size : 0;
}

int64_t LlamaStage::output_numel() const {
  return pass_ && !layout_.head ? pass_->rows() * config_.hidden_size : 0;
}

double LlamaStage::forward(int32_t mb, const int32_t* tokens, const int32_t* targets,
                           const float* input, float* output) {
  if (!pass_) throw std::logic_error("llama stage: forward before set_shape");
  if (microbatches_.count(mb)) {
    throw std::logic_error(microbatch_name(mb) +
                           " is already in flight: its backward must run "
                           "before another forward of it");
  }
  require(layout_.embedding ? tokens != nullptr : input != nullptr,
          layout_.embedding ? "the first stage's forward needs tokens"
                            : "a stage without the embedding needs the input hidden states");
  require(layout_.head ? targets != nullptr : output != nullptr,
          layout_.head ? "the last stage's forward needs targets"
                       : "a stage without the head needs an output buffer");
  DecoderPass& pass = *pass_;
  const int64_t N = pass.rows(), H = config_.hidden_size, root = root_unit(config_);
  if (layout_.embedding) check_tokens(tokens, N, config_.vocab_size, "tokens");
  if (layout_.head) check_tokens(targets, N, config_.vocab_size, "targets");

  auto state = std::make_unique<Microbatch>();
  state->saved = std::make_unique<Microbatch::Saved>(pass, layout_);
  Microbatch::Saved& saved = *state->saved;
  if (holds_root()) enter(root, nullptr, false);
  if (layout_.embedding) {
    std::copy_n(tokens, N, saved.tokens.begin());
    kernels::embedding_forward(saved.stream(0, output), saved.tokens.data(),
                               parameters_[size_t(embed_index_)].data, N, H);
  } else {
    std::copy_n(input, N * H, saved.stream(0, output));
  }
  for (int64_t i = 0; i < layer_count(); ++i) {
    const int64_t layer = layout_.first_layer + i;
    enter(layer, saved.stream(i, output), false);
    layer_forward(pass, layer_views(layer), saved.stream(i, output), saved.layers[size_t(i)],
                  saved.stream(i + 1, output));
    hooks_.post_forward(layer, saved.stream(i + 1, output), N * H);
  }
  double loss = 0;
  if (layout_.head) {
    std::copy_n(targets, N, saved.targets.begin());
    loss = head_forward(pass, parameters_[size_t(norm_index_)], parameters_[size_t(lm_head_index_)],
                        saved.stream(layer_count(), output), saved.targets.data(), *saved.head);
  }
  if (holds_root()) hooks_.post_forward(root, nullptr, 0);
  microbatches_.emplace(mb, std::move(state));
  return loss;
}

LlamaStage::Microbatch& LlamaStage::forwarded(int32_t mb, const char* action) {
  const auto found = microbatches_.find(mb);
  if (found == microbatches_.end()) {
    throw std::logic_error(microbatch_name(mb) + ": " + action + " without its forward");
  }
  if (!found->second->saved) {
    throw std::logic_error(microbatch_name(mb) + ": " + action +
                           " after its backward_input; backward_weight finishes it");
  }
  return *found->second;
}

void LlamaStage::backward(int32_t mb, float loss_scale, const float* grad_output,
                          float* grad_input) {
  AnnouncedGradients gradients(*this);
  backward_pass(forwarded(mb, "backward"), loss_scale, grad_output, grad_input, gradients);
  if (layout_.embedding) hooks_.gradient_ready(parameters_[size_t(embed_index_)].index);
  if (holds_root()) hooks_.post_backward(root_unit(config_));
  microbatches_.erase(mb);
}

void LlamaStage::backward_input(int32_t mb, float loss_scale, const float* grad_output,
                                float* grad_input) {
  Microbatch& state = forwarded(mb, "backward_input");
  DeferredWeightGradients gradients(state.pending, hooks_);
  backward_pass(state, loss_scale, grad_output, grad_input, gradients);
  // A tied lm_head still adds to the embedding's gradient in the weight pass.
  if (layout_.embedding && !config_.tie_word_embeddings) {
    hooks_.gradient_ready(parameters_[size_t(embed_index_)].index);
  }
  if (holds_root()) hooks_.post_backward(root_unit(config_));
  state.saved.reset();
}

// The linears in the order backward_input kept them, each unit's bracketed
// by its hooks, inside the root's.
void LlamaStage::backward_weight(int32_t mb) {
  const auto found = microbatches_.find(mb);
  if (found == microbatches_.end() || found->second->saved) {
    throw std::logic_error(microbatch_name(mb) + ": backward_weight needs its backward_input " +
                           "first");
  }
  const int64_t root = root_unit(config_);
  if (holds_root()) enter(root, nullptr, true);
  int64_t current = -1;
  for (const PendingLinear& linear : found->second->pending) {
    const int64_t unit = linear.first->unit;
    if (unit != root && unit != current) {
      if (current >= 0) hooks_.post_backward(current);
      enter(unit, nullptr, true);
      current = unit;
    }
    kernels::linear_backward_weight(linear.first->grad, linear.dy.data(), linear.x.data(),
                                    linear.rows, linear.in, linear.out);
    for (int64_t v = linear.views - 1; v >= 0; --v) hooks_.gradient_ready(linear.first[v].index);
  }
  if (current >= 0) hooks_.post_backward(current);
  if (holds_root()) hooks_.post_backward(root);
  microbatches_.erase(found);
}

void LlamaStage::discard(int32_t mb) {
  if (microbatches_.erase(mb) == 0) {
    throw std::logic_error(microbatch_name(mb) + ": discard of a microbatch not in flight");
  }
}

// The forward in reverse through pass_->d_residual, the gradient of the
// residual stream: from the loss or grad_output, through the layers, into
// the embedding or grad_input. Leaves the root's post_backward to the
// caller, after the embedding's gradient is announced.
void LlamaStage::backward_pass(Microbatch& state, float loss_scale, const float* grad_output,
                               float* grad_input, WeightGradients& gradients) {
  require(layout_.head || grad_output != nullptr,
          "a stage without the head needs grad_output for its backward");
  require(layout_.embedding || grad_input != nullptr,
          "a stage without the embedding needs a grad_input buffer for its backward");
  DecoderPass& pass = *pass_;
  Microbatch::Saved& saved = *state.saved;
  const int64_t N = pass.rows(), H = config_.hidden_size, layers = layer_count();
  if (holds_root()) enter(root_unit(config_), nullptr, true);
  if (layout_.head) {
    head_backward(pass, parameters_[size_t(norm_index_)], parameters_[size_t(lm_head_index_)],
                  saved.stream(layers, nullptr), saved.targets.data(), loss_scale, *saved.head,
                  gradients);
  } else {
    std::copy_n(grad_output, N * H, pass.d_residual.begin());
  }
  for (int64_t i = layers - 1; i >= 0; --i) {
    const int64_t layer = layout_.first_layer + i;
    enter(layer, nullptr, true);
    layer_backward(pass, layer_views(layer), saved.stream(i, nullptr), saved.layers[size_t(i)],
                   gradients);
    hooks_.post_backward(layer);
  }
  if (layout_.embedding) {
    kernels::embedding_backward(parameters_[size_t(embed_index_)].grad, saved.tokens.data(),
                                pass.d_residual.data(), N, H);
  } else {
    std::copy_n(pass.d_residual.begin(), N * H, grad_input);
  }
}

int64_t LlamaStage::activation_bytes() const {
  int64_t total = 0;
  for (const auto& [mb, state] : microbatches_) total += state->bytes();
  return total;
}

}  // namespace meshrun::llama
