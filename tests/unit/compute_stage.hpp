// A kit stage (models::TransformerStage<kit::Composed>) whose parameters and
// gradients, like its activations, are the memory of a given compute
// (models/common/compute.hpp): what a stage on a GPU computes with, for the
// tests that run one on a compute other than the host's (the fenced one of
// tests/unit, a GPU's in tests/gpu). Weights come by name from host
// vectors, so that stages on two computes start alike.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/buffer.hpp"
#include "kit/composed.hpp"
#include "kit_compositions.hpp"

namespace compute_stage {

using meshrun::kit::Composed;
using meshrun::kit::Composition;
using meshrun::models::ParameterView;
using Stage = meshrun::models::TransformerStage<Composed>;
// Values by parameter name, in host memory.
using Values = std::map<std::string, std::vector<float>>;

constexpr int64_t kLayers = 2;

// A Qwen2-like layer (Llama's with attention biases), a Phi-like one (a
// parallel block, partial rotary, lm_head's bias), a GPT-2-like one
// (LayerNorm, Conv1D, learned positions), a Mixtral-like mixture of experts.
inline Composition composition(const std::string& family) {
  if (family == "qwen2") return kit_test::qwen2_like(kLayers);
  if (family == "phi") return kit_test::phi_like(kLayers);
  if (family == "gpt2") return kit_test::gpt2_like(kLayers);
  return kit_test::mixtral_like(kLayers, 0.02);
}

// Values far enough from 0 that every term of the backward shows.
inline Values random_weights(const Composition& c, uint32_t seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<float> normal(0.0f, 0.4f);
  Values weights;
  for (const ParameterView& view : Composed::parameters(c)) {
    std::vector<float>& values = weights[view.name];
    values.resize(size_t(view.numel));
    const bool norm_weight = view.shape.size() == 1 && view.name.ends_with("weight");
    for (float& value : values) value = (norm_weight ? 1.0f : 0.0f) + normal(engine);
  }
  return weights;
}

// Tokens and targets of one micro-batch [batch, seq_len].
struct Tokens {
  std::vector<int32_t> tokens, targets;
};

inline Tokens random_tokens(int64_t vocab, int64_t count, uint32_t seed) {
  std::mt19937 engine(seed);
  std::uniform_int_distribution<int32_t> token(0, int32_t(vocab - 1));
  Tokens made{std::vector<int32_t>(size_t(count)), std::vector<int32_t>(size_t(count))};
  for (int32_t& t : made.tokens) t = token(engine);
  for (int32_t& t : made.targets) t = token(engine);
  return made;
}

// Hooks that do nothing but bind views to the parameters they were given.
class BindingHooks : public meshrun::models::StageHooks {
 public:
  void pre_forward(int64_t /*unit*/, float* /*hidden*/, int64_t /*numel*/) override {}
  void post_forward(int64_t /*unit*/, float* /*hidden*/, int64_t /*numel*/) override {}
  void pre_backward(int64_t /*unit*/) override {}
  void post_backward(int64_t /*unit*/) override {}
  void gradient_ready(int64_t /*parameter*/) override {}
  void bind(ParameterView& view, bool backward) override {
    const auto owned = std::find_if(views_.begin(), views_.end(),
                                    [&](const ParameterView& v) { return v.index == view.index; });
    view.data = owned->data;
    view.grad = backward ? owned->grad : nullptr;
  }

 protected:
  std::vector<ParameterView> views_;
};

// The model-parallel ranks a stage computes over (whose groups move its
// compute's memory): none by default.
struct Parallel {
  meshrun::models::TensorParallelGroup* tp = nullptr;
  meshrun::models::Placements placements;
  meshrun::models::ContextParallel cp;
  meshrun::models::ExpertParallel ep;
};

// The stage of `layout` on `compute` (which must outlive it), its
// parameters `weights` (over tp ranks its pieces, over ep ranks those of
// its experts) and its gradients zero, both in the compute's memory, over
// the ranks of `parallel`.
class ComputeStage : public BindingHooks {
 public:
  ComputeStage(const Composition& c, const meshrun::models::StageLayout& layout,
               const meshrun::models::Checkpointing& checkpointing, bool bfloat16,
               meshrun::models::Compute& compute, const Values& weights,
               const Parallel& parallel = {})
      : compute_(compute),
        stage_(std::make_unique<Stage>(c, layout, *this, checkpointing, parallel.tp,
                                       parallel.placements, parallel.cp, parallel.ep, bfloat16,
                                       compute)) {
    views_ = stage_->parameters();
    int64_t total = 0;
    for (const ParameterView& view : views_) total += view.numel;
    params_ = meshrun::models::Buffer<float>(size_t(total), compute);
    grads_ = meshrun::models::Buffer<float>(size_t(total), compute);
    int64_t offset = 0;
    for (ParameterView& view : views_) {
      view.data = params_.data() + offset;
      view.grad = grads_.data() + offset;
      compute.copy_from_host(view.data, weights.at(view.name).data(),
                             view.numel * int64_t(sizeof(float)));
      offset += view.numel;
    }
  }
  Stage& stage() { return *stage_; }
  // The gradients, copied to host memory.
  Values gradients() const {
    Values all;
    for (const ParameterView& view : views_) {
      std::vector<float>& values = all[view.name];
      values.resize(size_t(view.numel));
      compute_.copy_to_host(values.data(), view.grad, view.numel * int64_t(sizeof(float)));
    }
    return all;
  }

 private:
  meshrun::models::Compute& compute_;
  std::unique_ptr<Stage> stage_;
  meshrun::models::Buffer<float> params_, grads_;
};

// Token ids copied into a compute's memory, where a stage on it reads them.
class ComputeIds {
 public:
  ComputeIds(const std::vector<int32_t>& ids, meshrun::models::Compute& compute)
      : ids_(ids.size(), compute) {
    compute.copy_from_host(ids_.data(), ids.data(), int64_t(ids.size() * sizeof(int32_t)));
  }
  const int32_t* data() const { return ids_.data(); }

 private:
  meshrun::models::Buffer<int32_t> ids_;
};

// Two micro-batches in flight on the whole-model stage (on `compute`), the
// second's backward split into its input and weight passes as a zero-bubble
// schedule runs them; their losses.
inline std::vector<double> two_microbatches(Stage& stage, const std::vector<Tokens>& data,
                                            int64_t batch, int64_t seq_len,
                                            meshrun::models::Compute& compute) {
  stage.set_shape(batch, seq_len);
  std::vector<double> losses;
  for (int32_t mb = 0; mb < 2; ++mb) {
    const ComputeIds tokens(data[size_t(mb)].tokens, compute);
    const ComputeIds targets(data[size_t(mb)].targets, compute);
    losses.push_back(stage.forward(mb, tokens.data(), targets.data(), nullptr, nullptr));
  }
  stage.backward(0, 0.5f, nullptr, nullptr);
  stage.backward_input(1, 0.5f, nullptr, nullptr);
  stage.backward_weight(1);
  return losses;
}

}  // namespace compute_stage
