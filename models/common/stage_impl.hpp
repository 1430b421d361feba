// The definitions of TransformerStage<Family> (stage.hpp), included by the
// one source file of each family that instantiates it.
#pragma once

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "common/stage.hpp"
#include "common/support.hpp"
#include "numeric/gemm.hpp"

namespace meshrun::models {

namespace stage_detail {

// A linear's weight gradient that backward_input left for backward_weight,
// with copies of its dy and its x.
struct PendingLinear {
  LinearWeight weight;
  Buffer<float> dy, x;
};

}  // namespace stage_detail

// Computes the weight gradients at once and announces each to the hooks;
// the embedding's (which a tied lm_head shares) wait for the embedding's
// own backward.
template <class Family>
class TransformerStage<Family>::AnnouncedGradients : public ImmediateWeightGradients {
 public:
  explicit AnnouncedGradients(TransformerStage& stage) : stage_(stage) {}

 private:
  void ready(const ParameterView& view) override {
    const bool embedding =
        stage_.layout_.embedding &&
        &view - stage_.parameters_.data() < Family::embedding_tensors(stage_.config_);
    if (!embedding) stage_.hooks_.gradient_ready(view.index);
  }
  TransformerStage& stage_;
};

// Keeps each linear's dy and x for the weight pass; the vectors' gradients
// are final at once.
template <class Family>
class TransformerStage<Family>::DeferredGradients : public WeightGradients {
 public:
  DeferredGradients(std::vector<stage_detail::PendingLinear>& pending, StageHooks& hooks)
      : pending_(pending), hooks_(hooks) {}
  void linear(const LinearWeight& weight, const float* dy, Buffer<float>& x) override {
    Buffer<float> kept_dy(size_t(weight.rows * weight.out), *weight.compute);
    weight.compute->copy(kept_dy.data(), dy, weight.rows * weight.out);
    pending_.push_back({weight, std::move(kept_dy), std::move(x)});
  }
  void vector_ready(const ParameterView& view) override { hooks_.gradient_ready(view.index); }

 private:
  std::vector<stage_detail::PendingLinear>& pending_;
  StageHooks& hooks_;
};

// One microbatch in flight: what its forward kept (until its backward, or
// its backward_input), then what backward_input kept for backward_weight.
template <class Family>
struct TransformerStage<Family>::Microbatch {
  using Pass = typename Family::Pass;
  using LayerActivations = typename Family::LayerActivations;
  using HeadActivations = typename Family::HeadActivations;

  // The forward's state. residual holds the stage's input and each layer's
  // output that a backward reads: with L layers, slots 0..L-1 (the layers'
  // inputs) and, with the head, slot L (the final norm's input). Without
  // the head the last output goes straight to the caller's buffer. A
  // fully recomputed layer keeps no activations, a selective one none of
  // its element-wise ones. Kept in bfloat16, a layer's and the head's
  // low_precision() buffers are empty but while a forward or backward
  // computes them: their values are in `copies` and `head_copies`.
  struct Saved {
    Saved(const Pass& pass, const StageLayout& layout,
          const std::vector<std::optional<Recomputation>>& checkpointed, bool bfloat16,
          Compute& compute)
        : tokens(layout.embedding ? size_t(pass.rows()) : 0, compute),
          targets(layout.head ? size_t(pass.rows()) : 0, compute),
          residual(size_t((layout.end_layer - layout.first_layer + (layout.head ? 1 : 0)) *
                          pass.stream_numel()),
                   compute),
          layers(checkpointed.size()),
          copies(checkpointed.size()),
          hidden(pass.stream_numel()) {
      for (size_t i = 0; i < layers.size(); ++i) {
        if (checkpointed[i] == Recomputation::full) continue;
        layers[i].emplace(pass);
        if (bfloat16) release(Family::low_precision(*layers[i]));
        if (checkpointed[i]) release(Family::elementwise(*layers[i]));
      }
      if (layout.head) head.emplace(pass);
      if (head && bfloat16) release(Family::low_precision(*head));
    }
    int64_t bytes() const {
      int64_t total = bytes_of(tokens, targets, residual) + bytes_of_copies(head_copies);
      for (const auto& layer : layers) total += layer ? layer->bytes() : 0;
      for (const BfloatCopies& layer : copies) total += bytes_of_copies(layer);
      return total + (head ? head->bytes() : 0);
    }
    // Residual slot `slot`, else (one past the last) the caller's output.
    float* stream(int64_t slot, float* output) {
      return slot * hidden < int64_t(residual.size()) ? residual.data() + slot * hidden : output;
    }

    Buffer<int32_t> tokens, targets;
    Buffer<float> residual;
    std::vector<std::optional<LayerActivations>> layers;
    std::vector<BfloatCopies> copies;  // per layer
    std::optional<HeadActivations> head;
    BfloatCopies head_copies;
    int64_t hidden;  // elements of one slot
  };

  int64_t bytes() const {
    int64_t total = saved ? saved->bytes() : 0;
    for (const auto& linear : pending) total += bytes_of(linear.dy, linear.x);
    return total;
  }

  std::unique_ptr<Saved> saved;  // null once backward_input has run
  std::vector<stage_detail::PendingLinear> pending;
};

// What checkpointed layers compute into, in their forward and again in
// their backward: a fully recomputed layer's activations and its output
// (the residual stream holds the real one, which the backward does not
// read); a selective layer's element-wise activations, swapped in and out
// of the microbatch's own. The last forward's activations are still there
// when its backward comes next (a step without a pipeline does so for its
// last layer), and need no recompute. When layers keep their activations
// in bfloat16, a fully recomputed layer computes its low_precision()
// buffers in the stage's working buffers, which other layers reuse: its
// backward always computes them again.
template <class Family>
struct TransformerStage<Family>::Scratch {
  Scratch(const typename Family::Pass& pass, bool full, bool selective, bool bfloat16,
          Compute& compute)
      : bfloat16(bfloat16), output(compute) {
    if (selective) {
      typename Family::LayerActivations all(pass);
      for (Buffer<float>* buffer : Family::elementwise(all)) {
        elementwise_sizes.push_back(buffer->size());
        elementwise.push_back(std::move(*buffer));
      }
    }
    if (full) {
      renew_layer(pass);
      layer_bytes = layer->bytes();
      output.resize(pass.stream_numel());
    }
  }
  int64_t bytes() const {
    int64_t total = (layer ? layer->bytes() : 0) + bytes_of(output);
    for (const Buffer<float>& buffer : elementwise) total += bytes_of(buffer);
    return total;
  }
  bool holds(const Microbatch& state, int64_t i) const {
    return holder == &state && holder_layer == i;
  }
  void swap_elementwise(typename Family::LayerActivations& activations) {
    const auto buffers = Family::elementwise(activations);
    for (size_t k = 0; k < buffers.size(); ++k) buffers[k]->swap(elementwise[k]);
  }
  void renew_layer(const typename Family::Pass& pass) {
    layer.emplace(pass);
    if (bfloat16) release(Family::low_precision(*layer));
  }

  bool bfloat16;
  std::optional<typename Family::LayerActivations> layer;  // with a fully recomputed layer
  int64_t layer_bytes = 0;                                 // while it holds all its buffers
  Buffer<float> output;
  std::vector<Buffer<float>> elementwise;
  std::vector<size_t> elementwise_sizes;
  // Whose forward activations the scratch holds, as stage layer
  // holder_layer; null once a backward has used or changed them.
  const Microbatch* holder = nullptr;
  int64_t holder_layer = -1;
};

template <class Family>
TransformerStage<Family>::TransformerStage(Config config, StageLayout layout, StageHooks& hooks,
                                           const Checkpointing& checkpointing,
                                           TensorParallelGroup* tp, const Placements& placements,
                                           const ContextParallel& cp, const ExpertParallel& ep,
                                           bool bfloat16_activations, Compute& compute)
    : config_(std::move(config)),
      layout_(layout),
      hooks_(hooks),
      compute_(compute),
      tp_(tp != nullptr ? *tp : single_rank_),
      sequence_parallel_(tp_.size() > 1 && placements.sequence_parallel),
      cp_(cp),
      ep_(ep),
      bfloat16_activations_(bfloat16_activations) {
  require(kAnyCompute || &compute_ == &host_compute(), Family::kName,
          "the model computes on the host's memory only");
  Family::check_config(config_);
  check_layout();
  check_checkpointing(checkpointing);
  kernels::use_one_gemm_thread_by_default();
  select_parameters();
  for (int64_t layer = layout_.first_layer; layer < layout_.end_layer; ++layer) {
    const auto found = checkpointing.find(layer);
    checkpointed_.push_back(
        found == checkpointing.end() ? std::nullopt : std::optional<Recomputation>(found->second));
  }
  if (tp_.size() > 1) {
    require(!sequence_parallel_ || Family::kSequenceParallel, Family::kName,
            "sequence parallelism: the model computes tensor parallelism with its residual "
            "stream replicated over tp ranks only (distributed.sequence_parallel = false)");
    localize(placements);
    Family::check_tensor_parallel(config_, tp_.size(), blocks_);
  }
}

// The plan may place a parameter as the family computes it, or replicate
// its whole block; a sharded view has the rank's extent.
template <class Family>
void TransformerStage<Family>::localize(const Placements& placements) {
  const auto block_of = [this](const std::string& name) {
    return Family::tensor_parallel_block(config_, name);
  };
  blocks_ = planned_blocks(parameters_, placements, block_of, Family::kName);
  if (config_.tie_word_embeddings) blocks_.set(Block::head, blocks_[Block::embedding]);
  for (ParameterView& view : parameters_) {
    const auto found = placements.of.find(view.name);
    view.tp = found != placements.of.end() ? found->second : "replicate";
    if (view.tp == "replicate") continue;
    view.shape[size_t(view.tp[6] - '0')] /= tp_.size();
    view.numel /= tp_.size();
  }
}

template <class Family>
TransformerStage<Family>::~TransformerStage() = default;

template <class Family>
void TransformerStage<Family>::check_layout() const {
  const int64_t L = Family::num_layers(config_);
  const char* name = Family::kName;
  require(0 <= layout_.first_layer && layout_.first_layer <= layout_.end_layer &&
              layout_.end_layer <= L,
          name,
          "stage layers [" + std::to_string(layout_.first_layer) + ", " +
              std::to_string(layout_.end_layer) + ") are not within the model's [0, " +
              std::to_string(L) + ")");
  require(!layout_.embedding || layout_.first_layer == 0, name,
          "the embedding goes on the stage of layer 0, not one starting at layer " +
              std::to_string(layout_.first_layer));
  require(!layout_.head || layout_.end_layer == L, name,
          "the head (final norm, lm_head, loss) goes on the stage of the last layer, not one "
          "ending before layer " +
              std::to_string(layout_.end_layer));
  require(layer_count() > 0 || holds_root(), name,
          "a stage holds at least a layer, the embedding or the head");
  require(!config_.tie_word_embeddings || (layout_.embedding && layout_.head), name,
          "tie_word_embeddings needs the embedding and lm_head on one stage: tied embeddings "
          "cannot be split across pipeline stages");
}

template <class Family>
void TransformerStage<Family>::check_checkpointing(const Checkpointing& checkpointing) const {
  const int64_t L = Family::num_layers(config_);
  for (const auto& [layer, mode] : checkpointing) {
    require(layer >= 0 && layer < L, Family::kName,
            "checkpointed layer " + std::to_string(layer) + " is not within the model's [0, " +
                std::to_string(L) + ")");
  }
}

// The embedding's views come first in model order, the head's last; of
// the experts' only those the rank holds.
template <class Family>
void TransformerStage<Family>::select_parameters() {
  const int64_t first_outside = Family::num_layers(config_);
  int64_t outside_views = 0, head_views = 0;
  std::vector<ParameterView> all = Family::parameters(config_);
  int64_t experts = 0;
  for (const ParameterView& view : all) experts = std::max(experts, view.expert + 1);
  for (ParameterView& view : all) {
    if (!ep_.holds(view.expert, experts)) continue;
    const bool in_layers = view.unit >= layout_.first_layer && view.unit < layout_.end_layer;
    if (in_layers && (parameters_.empty() || parameters_.back().unit != view.unit)) {
      layer_first_view_.push_back(int64_t(parameters_.size()));
    }
    const bool outside = view.unit >= first_outside;
    const bool in_embedding = outside && outside_views++ < Family::embedding_tensors(config_);
    const bool in_head = outside && !in_embedding && layout_.head;
    head_views += in_head ? 1 : 0;
    if (in_layers || (in_embedding && layout_.embedding) || in_head) {
      parameters_.push_back(std::move(view));
    }
  }
  head_index_ = int64_t(parameters_.size()) - head_views;
  lm_head_index_ = config_.tie_word_embeddings ? 0 : int64_t(parameters_.size()) - 1;
}

template <class Family>
ParameterView* TransformerStage<Family>::layer_views(int64_t layer) {
  return &parameters_[size_t(layer_first_view_.at(size_t(layer - layout_.first_layer)))];
}

template <class Family>
std::span<const ParameterView> TransformerStage<Family>::layer_view_span(int64_t layer) const {
  const auto index = size_t(layer - layout_.first_layer);
  const auto begin = size_t(layer_first_view_.at(index));
  const auto end = index + 1 < layer_first_view_.size() ? size_t(layer_first_view_[index + 1])
                                                        : size_t(head_index_);
  return {parameters_.data() + begin, end - begin};
}

template <class Family>
void TransformerStage<Family>::enter(int64_t unit, float* hidden, bool backward) {
  if (backward) {
    hooks_.pre_backward(unit);
  } else {
    hooks_.pre_forward(unit, hidden, hidden != nullptr ? pass_->stream_numel() : 0);
  }
  for (ParameterView& view : parameters_) {
    if (view.unit == unit) hooks_.bind(view, backward);
  }
  if (unit < Family::num_layers(config_)) {
    Family::check_layer_storage(layer_view_span(unit), backward);
  }
}

template <class Family>
bool TransformerStage<Family>::holds_unit(int64_t unit) const {
  return std::any_of(parameters_.begin(), parameters_.end(),
                     [&](const ParameterView& view) { return view.unit == unit; });
}

template <class Family>
template <class Compute>
void TransformerStage<Family>::in_unit(int64_t unit, bool backward, Compute&& compute) {
  const bool held = holds_unit(unit);
  if (held) enter(unit, nullptr, backward);
  compute();
  if (held && backward) hooks_.post_backward(unit);
  if (held && !backward) hooks_.post_forward(unit, nullptr, 0);
}

template <class Family>
void TransformerStage<Family>::take_rows(const int32_t* full, Buffer<int32_t>& local,
                                         const char* what) const {
  // The ids are checked on the host, which costs one small copy back per
  // micro-batch; a GPU then waits for the writes before it, which the
  // loss's read-back at the end of forward does anyway.
  std::vector<int32_t> ids(size_t(batch_ * seq_len_));
  compute_.copy_to_host(ids.data(), full, int64_t(ids.size() * sizeof(int32_t)));
  check_tokens(ids.data(), batch_ * seq_len_, config_.vocab_size, what);
  const int64_t rank = cp_.group != nullptr ? cp_.group->rank() : 0;
  std::vector<int32_t> rows(local.size());
  SequenceShard{cp_.size(), rank, seq_len_}.select(ids.data(), rows.data(), batch_);
  compute_.copy_from_host(local.data(), rows.data(), int64_t(rows.size() * sizeof(int32_t)));
}

template <class Family>
double TransformerStage<Family>::context_parallel_mean(double loss) {
  auto value = float(loss);
  Buffer<float> sum(1, compute_);
  compute_.copy_from_host(sum.data(), &value, sizeof value);
  cp_.group->all_reduce_sum(sum.data(), 1);
  compute_.copy_to_host(&value, sum.data(), sizeof value);
  return double(value) / double(cp_.size());
}

template <class Family>
std::string TransformerStage<Family>::microbatch_name(int32_t mb) const {
  return std::string(Family::kName) + " stage: microbatch " + std::to_string(mb);
}

template <class Family>
void TransformerStage<Family>::set_shape(int64_t batch, int64_t seq_len) {
  require(batch > 0 && seq_len > 0, Family::kName,
          "stage set_shape needs batch > 0 and seq_len > 0");
  if (pass_ && batch_ == batch && seq_len_ == seq_len) return;
  if (!microbatches_.empty()) {
    throw std::logic_error(std::string(Family::kName) + " stage: set_shape while " +
                           std::to_string(microbatches_.size()) +
                           " microbatches are in flight; finish their backward first");
  }
  spare_.clear();
  scratch_.reset();
  kept_layer_.reset();
  kept_head_.reset();
  pass_.reset();  // the old shape's scratch goes before the new one comes
  require(cp_.size() == 1 || seq_len % (2 * cp_.size()) == 0, Family::kName,
          "context parallelism cuts each sequence into 2 x cp = " + std::to_string(2 * cp_.size()) +
              " chunks, which do not divide seq_len " + std::to_string(seq_len));
  if constexpr (kAnyCompute) {
    pass_ = std::make_unique<typename Family::Pass>(
        config_, batch, seq_len / cp_.size(), tp_, sequence_parallel_, blocks_, cp_, ep_, compute_);
  } else if constexpr (requires { Family::kExperts; }) {
    pass_ = std::make_unique<typename Family::Pass>(config_, batch, seq_len / cp_.size(), tp_,
                                                    sequence_parallel_, blocks_, cp_, ep_);
  } else {
    pass_ = std::make_unique<typename Family::Pass>(config_, batch, seq_len / cp_.size(), tp_,
                                                    sequence_parallel_, blocks_, cp_);
  }
  const auto any = [&](Recomputation mode) {
    return std::find(checkpointed_.begin(), checkpointed_.end(), mode) != checkpointed_.end();
  };
  if (any(Recomputation::full) || any(Recomputation::selective)) {
    scratch_ =
        std::make_unique<Scratch>(*pass_, any(Recomputation::full), any(Recomputation::selective),
                                  bfloat16_activations_, compute_);
  }
  pass_->bfloat16_activations = bfloat16_activations_;
  if (bfloat16_activations_) {
    const auto sizes = [](const LowPrecisionBuffers& buffers) {
      std::vector<size_t> floats;
      for (const Buffer<float>* buffer : buffers) floats.push_back(buffer->size());
      return floats;
    };
    if (layer_count() > 0) {
      typename Family::LayerActivations layer(*pass_);
      kept_layer_.emplace(sizes(Family::low_precision(layer)), compute_);
    }
    if (layout_.head) {
      typename Family::HeadActivations head(*pass_);
      kept_head_.emplace(sizes(Family::low_precision(head)), compute_);
    }
  }
  batch_ = batch;
  seq_len_ = seq_len;
}

template <class Family>
int64_t TransformerStage<Family>::input_numel() const {
  return pass_ && !layout_.embedding ? pass_->stream_numel() : 0;
}

template <class Family>
int64_t TransformerStage<Family>::output_numel() const {
  return pass_ && !layout_.head ? pass_->stream_numel() : 0;
}

template <class Family>
double TransformerStage<Family>::forward(int32_t mb, const int32_t* tokens, const int32_t* targets,
                                         const float* input, float* output) {
  const char* name = Family::kName;
  if (!pass_) throw std::logic_error(std::string(name) + " stage: forward before set_shape");
  if (microbatches_.count(mb)) {
    throw std::logic_error(microbatch_name(mb) +
                           " is already in flight: its backward must run "
                           "before another forward of it");
  }
  require(layout_.embedding ? tokens != nullptr : input != nullptr, name,
          layout_.embedding ? "the first stage's forward needs tokens"
                            : "a stage without the embedding needs the input hidden states");
  require(layout_.head ? targets != nullptr : output != nullptr, name,
          layout_.head ? "the last stage's forward needs targets"
                       : "a stage without the head needs an output buffer");
  auto& pass = *pass_;
  const int64_t stream = pass.stream_numel(), root = units().root;
  auto state = take_state();
  auto& saved = *state->saved;
  if (layout_.embedding) take_rows(tokens, saved.tokens, "tokens");
  if (layout_.head) take_rows(targets, saved.targets, "targets");
  if (holds_root()) enter(root, nullptr, false);
  if (layout_.embedding) {
    in_unit(units().embedding, false, [&] {
      Family::embedding_forward(pass, parameters_.data(), saved.tokens.data(),
                                saved.stream(0, output));
    });
  } else {
    compute_.copy(saved.stream(0, output), input, stream);
  }
  for (int64_t i = 0; i < layer_count(); ++i) {
    const int64_t layer = layout_.first_layer + i;
    enter(layer, saved.stream(i, output), false);
    forward_layer(*state, i, output);
    hooks_.post_forward(layer, saved.stream(i + 1, output), stream);
  }
  double loss = 0;
  if (layout_.head) {
    const LowPrecisionBuffers rounded = low_precision_head(*state);
    if (!rounded.empty()) kept_head_->lend(rounded);
    in_unit(units().head, false, [&] {
      loss = Family::head_forward(
          pass, &parameters_[size_t(head_index_)], parameters_[size_t(lm_head_index_)],
          saved.stream(layer_count(), output), saved.targets.data(), *saved.head);
    });
    if (!rounded.empty()) kept_head_->keep(rounded, saved.head_copies);
    if (cp_.size() > 1) loss = context_parallel_mean(loss);
  }
  if (holds_root()) hooks_.post_forward(root, nullptr, 0);
  microbatches_.emplace(mb, std::move(state));
  return loss;
}

template <class Family>
typename TransformerStage<Family>::Microbatch& TransformerStage<Family>::forwarded(
    int32_t mb, const char* action) {
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

template <class Family>
typename Family::LayerActivations& TransformerStage<Family>::activations(Microbatch& state,
                                                                         int64_t i) {
  auto& kept = state.saved->layers[size_t(i)];
  return kept ? *kept : *scratch_->layer;
}

namespace stage_detail {

// `buffers` with those among `elementwise` (or those not among them, when
// `recomputed`) null.
inline LowPrecisionBuffers selected(LowPrecisionBuffers buffers,
                                    const std::vector<Buffer<float>*>& elementwise,
                                    bool recomputed) {
  for (Buffer<float>*& buffer : buffers) {
    const bool among =
        std::find(elementwise.begin(), elementwise.end(), buffer) != elementwise.end();
    if (among != recomputed) buffer = nullptr;
  }
  return buffers;
}

}  // namespace stage_detail

template <class Family>
LowPrecisionBuffers TransformerStage<Family>::low_precision(Microbatch& state, int64_t i) {
  if (!bfloat16_activations_) return {};
  auto& written = activations(state, i);
  if (checkpointed_[size_t(i)] != Recomputation::selective) return Family::low_precision(written);
  return stage_detail::selected(Family::low_precision(written), Family::elementwise(written),
                                false);
}

template <class Family>
LowPrecisionBuffers TransformerStage<Family>::low_precision_head(Microbatch& state) {
  auto& kept = state.saved->head;
  return bfloat16_activations_ && kept ? Family::low_precision(*kept) : LowPrecisionBuffers{};
}

template <class Family>
void TransformerStage<Family>::forward_layer(Microbatch& state, int64_t i, float* output) {
  auto& saved = *state.saved;
  const bool selective = checkpointed_[size_t(i)] == Recomputation::selective;
  auto& written = activations(state, i);
  const LowPrecisionBuffers lent = low_precision(state, i);
  if (!lent.empty()) kept_layer_->lend(lent);
  if (checkpointed_[size_t(i)]) {
    scratch_->holder = &state;
    scratch_->holder_layer = i;
  }
  if (selective) scratch_->swap_elementwise(written);
  Family::layer_forward(*pass_, layer_views(layout_.first_layer + i), saved.stream(i, output),
                        written, saved.stream(i + 1, output));
  if (selective) scratch_->swap_elementwise(written);
  if (lent.empty()) return;
  if (checkpointed_[size_t(i)] == Recomputation::full) {
    kept_layer_->take_back(lent);
  } else {
    kept_layer_->keep(lent, saved.copies[size_t(i)]);
  }
}

// The forward again, as the forward ran it: the same input (the residual
// slot, as the hooks left it), parameters and ops; all of it, or for a
// selective layer the element-wise part from what it kept.
template <class Family>
void TransformerStage<Family>::backward_layer(Microbatch& state, int64_t i,
                                              WeightGradients& gradients) {
  auto& pass = *pass_;
  const ParameterView* views = layer_views(layout_.first_layer + i);
  const float* x = state.saved->stream(i, nullptr);
  const auto mode = checkpointed_[size_t(i)];
  auto& read = activations(state, i);
  const bool full = mode == Recomputation::full;
  const LowPrecisionBuffers lent = low_precision(state, i);
  if (!lent.empty() && full) kept_layer_->lend(lent);
  if (!lent.empty() && !full) kept_layer_->restore(lent, state.saved->copies[size_t(i)]);
  if (mode == Recomputation::selective) scratch_->swap_elementwise(read);
  // A fully recomputed layer's working buffers have served other layers.
  if (mode && ((full && !lent.empty()) || !scratch_->holds(state, i))) {
    if (full) {
      Family::layer_forward(pass, views, x, read, scratch_->output.data());
    } else {
      Family::recompute_elementwise(pass, views, x, read);
    }
  }
  if (mode) scratch_->holder = nullptr;
  // What the forward computed again is what keeping it would have left.
  if (mode && bfloat16_activations_) {
    round_to_bfloat16(full ? Family::low_precision(read)
                           : stage_detail::selected(Family::low_precision(read),
                                                    Family::elementwise(read), true));
  }
  Family::layer_backward(pass, views, x, read, gradients);
  if (mode == Recomputation::selective) scratch_->swap_elementwise(read);
  if (!lent.empty()) kept_layer_->take_back(lent);
  if (mode) restore_scratch();
}

template <class Family>
void TransformerStage<Family>::restore_scratch() {
  Scratch& scratch = *scratch_;
  if (scratch.layer && scratch.layer->bytes() != scratch.layer_bytes) {
    scratch.renew_layer(*pass_);
  }
  for (size_t k = 0; k < scratch.elementwise.size(); ++k) {
    if (scratch.elementwise[k].size() != scratch.elementwise_sizes[k]) {
      scratch.elementwise[k].resize(scratch.elementwise_sizes[k]);
    }
  }
}

template <class Family>
std::unique_ptr<typename TransformerStage<Family>::Microbatch>
TransformerStage<Family>::take_state() {
  if (!spare_.empty()) {
    auto state = std::move(spare_.back());
    spare_.pop_back();
    return state;
  }
  auto state = std::make_unique<Microbatch>();
  state->saved = std::make_unique<typename Microbatch::Saved>(*pass_, layout_, checkpointed_,
                                                              bfloat16_activations_, compute_);
  return state;
}

// Every activation of a forward is written before it is read, so a
// finished microbatch's buffers serve the next one as they are. A split
// backward moved some of them into its pending weight pass: that state is
// not kept.
template <class Family>
void TransformerStage<Family>::finish(
    typename std::map<int32_t, std::unique_ptr<Microbatch>>::iterator found) {
  std::unique_ptr<Microbatch> state = std::move(found->second);
  microbatches_.erase(found);
  if (state->saved && state->pending.empty()) spare_.push_back(std::move(state));
}

template <class Family>
void TransformerStage<Family>::announce_embedding(bool skip_lm_head) {
  if (!layout_.embedding) return;
  for (int64_t v = Family::embedding_tensors(config_) - 1; v >= 0; --v) {
    if (!(skip_lm_head && config_.tie_word_embeddings && v == lm_head_index_)) {
      hooks_.gradient_ready(parameters_[size_t(v)].index);
    }
  }
}

template <class Family>
void TransformerStage<Family>::backward(int32_t mb, float loss_scale, const float* grad_output,
                                        float* grad_input) {
  AnnouncedGradients gradients(*this);
  backward_pass(forwarded(mb, "backward"), loss_scale, grad_output, grad_input, gradients, false);
  if (holds_root()) hooks_.post_backward(units().root);
  finish(microbatches_.find(mb));
}

// A tied lm_head still adds to the embedding's gradient in the weight pass.
template <class Family>
void TransformerStage<Family>::backward_input(int32_t mb, float loss_scale,
                                              const float* grad_output, float* grad_input) {
  Microbatch& state = forwarded(mb, "backward_input");
  DeferredGradients gradients(state.pending, hooks_);
  backward_pass(state, loss_scale, grad_output, grad_input, gradients, true);
  if (holds_root()) hooks_.post_backward(units().root);
  state.saved.reset();
}

// The linears in the order backward_input kept them, each unit's bracketed
// by its hooks, inside the root's.
template <class Family>
void TransformerStage<Family>::backward_weight(int32_t mb) {
  const auto found = microbatches_.find(mb);
  if (found == microbatches_.end() || found->second->saved) {
    throw std::logic_error(microbatch_name(mb) + ": backward_weight needs its backward_input " +
                           "first");
  }
  const int64_t root = units().root;
  if (holds_root()) enter(root, nullptr, true);
  int64_t current = -1;
  for (const stage_detail::PendingLinear& linear : found->second->pending) {
    const int64_t unit = linear.weight.first->unit;
    if (unit != root && unit != current) {
      if (current >= 0) hooks_.post_backward(current);
      enter(unit, nullptr, true);
      current = unit;
    }
    accumulate_weight_gradient(linear.weight, linear.dy.data(), linear.x.data());
    for (const ParameterView* view = linear.weight.last; view >= linear.weight.first; --view) {
      hooks_.gradient_ready(view->index);
    }
  }
  if (current >= 0) hooks_.post_backward(current);
  if (holds_root()) hooks_.post_backward(root);
  finish(found);
}

template <class Family>
void TransformerStage<Family>::discard(int32_t mb) {
  const auto found = microbatches_.find(mb);
  if (found == microbatches_.end()) {
    throw std::logic_error(microbatch_name(mb) + ": discard of a microbatch not in flight");
  }
  finish(found);
}

// The forward in reverse through pass_->d_residual, the gradient of the
// residual stream: from the loss or grad_output, through the layers, into
// the embedding or grad_input; the embedding's gradients announced, a tied
// lm_head's left to the weight pass when `weights_deferred`. Leaves the
// root's post_backward to the caller.
template <class Family>
void TransformerStage<Family>::backward_pass(Microbatch& state, float loss_scale,
                                             const float* grad_output, float* grad_input,
                                             WeightGradients& gradients, bool weights_deferred) {
  require(layout_.head || grad_output != nullptr, Family::kName,
          "a stage without the head needs grad_output for its backward");
  require(layout_.embedding || grad_input != nullptr, Family::kName,
          "a stage without the embedding needs a grad_input buffer for its backward");
  auto& pass = *pass_;
  auto& saved = *state.saved;
  const int64_t stream = pass.stream_numel(), layers = layer_count();
  if constexpr (requires { Family::kExperts; }) pass.loss_scale = loss_scale;
  if (holds_root()) enter(units().root, nullptr, true);
  if (layout_.head) {
    const LowPrecisionBuffers rounded = low_precision_head(state);
    if (!rounded.empty()) kept_head_->restore(rounded, saved.head_copies);
    in_unit(units().head, true, [&] {
      Family::head_backward(pass, &parameters_[size_t(head_index_)],
                            parameters_[size_t(lm_head_index_)], saved.stream(layers, nullptr),
                            saved.targets.data(), loss_scale, *saved.head, gradients);
    });
    if (!rounded.empty()) kept_head_->take_back(rounded);
  } else {
    compute_.copy(pass.d_residual.data(), grad_output, stream);
  }
  for (int64_t i = layers - 1; i >= 0; --i) {
    const int64_t layer = layout_.first_layer + i;
    enter(layer, nullptr, true);
    backward_layer(state, i, gradients);
    hooks_.post_backward(layer);
  }
  if (layout_.embedding) {
    in_unit(units().embedding, true, [&] {
      Family::embedding_backward(pass, parameters_.data(), saved.tokens.data());
      announce_embedding(weights_deferred);
    });
  } else {
    compute_.copy(grad_input, pass.d_residual.data(), stream);
  }
}

template <class Family>
int64_t TransformerStage<Family>::activation_bytes() const {
  int64_t total = scratch_ && !microbatches_.empty() ? scratch_->bytes() : 0;
  for (const auto& [mb, state] : microbatches_) total += state->bytes();
  return total;
}

}  // namespace meshrun::models
