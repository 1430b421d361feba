// Llama stages over storage of their own, for the tests of models/llama: an
// OwnedStage keeps its parameters and gradients in two flat buffers in the
// stage's parameter order, as a replicated host does, binds the stage's
// views to them and passes the unit-boundary calls on to an observer; an
// OwnedModel is the stage of the whole model, one microbatch at a time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "llama/model.hpp"
#include "llama/stage.hpp"

namespace llama_fixture {

using meshrun::llama::LlamaConfig;
using meshrun::llama::LlamaStage;
using meshrun::llama::ParameterView;
using meshrun::llama::StageHooks;
using meshrun::llama::StageLayout;

class OwnedStage : public StageHooks {
 public:
  OwnedStage(const LlamaConfig& config, const StageLayout& layout)
      : stage_(std::make_unique<LlamaStage>(config, layout, *this)) {
    views_ = stage_->parameters();
    int64_t total = 0;
    for (const ParameterView& view : views_) total += view.numel;
    params_.assign(size_t(total), 0.0f);
    grads_.assign(size_t(total), 0.0f);
    int64_t offset = 0;
    for (ParameterView& view : views_) {
      view.data = params_.data() + offset;
      view.grad = grads_.data() + offset;
      offset += view.numel;
    }
  }
  OwnedStage(const OwnedStage&) = delete;
  OwnedStage& operator=(const OwnedStage&) = delete;

  LlamaStage& stage() { return *stage_; }
  const LlamaStage& stage() const { return *stage_; }
  const LlamaConfig& config() const { return stage_->config(); }
  // The stage's parameters, bound to the buffers for good.
  std::vector<ParameterView>& parameters() { return views_; }
  const std::vector<ParameterView>& parameters() const { return views_; }
  float* param_buffer() { return params_.data(); }
  float* grad_buffer() { return grads_.data(); }
  int64_t num_parameters() const { return int64_t(params_.size()); }
  void zero_grad() { std::fill(grads_.begin(), grads_.end(), 0.0f); }
  // Receives every call but bind; nullptr: none.
  void set_observer(StageHooks* observer) { observer_ = observer; }

  void pre_forward(int64_t unit, float* hidden, int64_t numel) override {
    if (observer_) observer_->pre_forward(unit, hidden, numel);
  }
  void post_forward(int64_t unit, float* hidden, int64_t numel) override {
    if (observer_) observer_->post_forward(unit, hidden, numel);
  }
  void pre_backward(int64_t unit) override {
    if (observer_) observer_->pre_backward(unit);
  }
  void post_backward(int64_t unit) override {
    if (observer_) observer_->post_backward(unit);
  }
  void gradient_ready(int64_t parameter) override {
    if (observer_) observer_->gradient_ready(parameter);
  }
  void bind(ParameterView& view, bool backward) override {
    const ParameterView& owned = owned_view(view.index);
    view.data = owned.data;
    view.grad = backward ? owned.grad : nullptr;
  }

 private:
  const ParameterView& owned_view(int64_t index) const {
    return *std::find_if(views_.begin(), views_.end(),
                         [&](const ParameterView& view) { return view.index == index; });
  }

  std::unique_ptr<LlamaStage> stage_;
  std::vector<ParameterView> views_;
  std::vector<float> params_, grads_;
  StageHooks* observer_ = nullptr;
};

// The whole model; forward and backward of one microbatch at a time, a new
// forward dropping what an earlier one kept.
class OwnedModel : public OwnedStage {
 public:
  explicit OwnedModel(const LlamaConfig& config)
      : OwnedStage(config, {0, config.num_hidden_layers, true, true}) {
    init_weights(0);
  }

  void init_weights(uint64_t seed) {
    const auto all = meshrun::llama::model_parameters(config());
    for (ParameterView& view : parameters()) {
      meshrun::llama::init_parameter(all, seed, view.index, view.data);
    }
  }
  float forward(const int32_t* tokens, const int32_t* targets, int64_t batch, int64_t seq_len) {
    if (stage().activation_bytes() > 0) stage().discard(0);
    stage().set_shape(batch, seq_len);
    return float(stage().forward(0, tokens, targets, nullptr, nullptr));
  }
  void backward() { stage().backward(0, 1.0f, nullptr, nullptr); }
};

}  // namespace llama_fixture
