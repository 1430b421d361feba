// A kit model's stage keeps every activation, gradient and scratch buffer
// in its compute's memory and touches them only through the compute's
// calls: what lets the same stage run on a GPU. Checked on the CPU with a
// compute whose memory faults when the host touches it outside its calls
// (fenced_compute.hpp), against the host's compute: the same losses and
// gradients bit for bit (the same kernels run, in the same order).
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/buffer.hpp"
#include "fenced_compute.hpp"
#include "kit/composed.hpp"
#include "kit_compositions.hpp"
#include "llama/decoder.hpp"
#include "stage_fixture.hpp"

namespace model_buffers_test {

using fenced::FencedCompute;
using meshrun::kit::Composed;
using meshrun::kit::Composition;
using meshrun::models::Buffer;
using meshrun::models::Checkpointing;
using meshrun::models::ParameterView;
using meshrun::models::Recomputation;
using meshrun::models::StageLayout;
using Stage = meshrun::models::TransformerStage<Composed>;
using HostStage = stage_fixture::OwnedStage<Composed>;
using Gradients = std::map<std::string, std::vector<float>>;

using kit_test::kBatch;
using kit_test::kSeqLen;
using kit_test::kVocab;
constexpr int64_t kLayers = 2;

// A Qwen2-like layer (Llama's with attention biases), a Phi-like one (a
// parallel block, partial rotary, lm_head's bias), a GPT-2-like one
// (LayerNorm, Conv1D, learned positions), a Mixtral-like mixture of experts.
Composition composition(const std::string& family) {
  if (family == "qwen2") return kit_test::qwen2_like(kLayers);
  if (family == "phi") return kit_test::phi_like(kLayers);
  if (family == "gpt2") return kit_test::gpt2_like(kLayers);
  return kit_test::mixtral_like(kLayers, 0.02);
}

// Values far enough from 0 that every term of the backward shows.
std::map<std::string, std::vector<float>> random_weights(const Composition& c, uint32_t seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<float> normal(0.0f, 0.4f);
  std::map<std::string, std::vector<float>> weights;
  for (const ParameterView& view : Composed::parameters(c)) {
    std::vector<float>& values = weights[view.name];
    values.resize(size_t(view.numel));
    const bool norm_weight = view.shape.size() == 1 && view.name.ends_with("weight");
    for (float& value : values) value = (norm_weight ? 1.0f : 0.0f) + normal(engine);
  }
  return weights;
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

// A stage whose parameters and gradients, like its activations, are the
// fenced compute's memory.
class FencedStage : public BindingHooks {
 public:
  FencedStage(const Composition& c, const StageLayout& layout, const Checkpointing& checkpointing,
              bool bfloat16, FencedCompute& compute,
              const std::map<std::string, std::vector<float>>& weights)
      : compute_(compute),
        stage_(std::make_unique<Stage>(c, layout, *this, checkpointing, nullptr,
                                       meshrun::models::Placements{},
                                       meshrun::models::ContextParallel{},
                                       meshrun::models::ExpertParallel{}, bfloat16, compute)) {
    views_ = stage_->parameters();
    int64_t total = 0;
    for (const ParameterView& view : views_) total += view.numel;
    params_ = Buffer<float>(size_t(total), compute);
    grads_ = Buffer<float>(size_t(total), compute);
    int64_t offset = 0;
    for (ParameterView& view : views_) {
      view.data = params_.data() + offset;
      view.grad = grads_.data() + offset;
      compute.copy_from_host(view.data, weights.at(view.name).data(), view.numel * 4);
      offset += view.numel;
    }
  }
  Stage& stage() { return *stage_; }
  Gradients gradients() const {
    Gradients all;
    for (const ParameterView& view : views_) {
      std::vector<float>& values = all[view.name];
      values.resize(size_t(view.numel));
      compute_.copy_to_host(values.data(), view.grad, view.numel * 4);
    }
    return all;
  }

 private:
  FencedCompute& compute_;
  std::unique_ptr<Stage> stage_;
  Buffer<float> params_, grads_;
};

std::unique_ptr<HostStage> host_stage(const Composition& c, const StageLayout& layout,
                                      const Checkpointing& checkpointing, bool bfloat16,
                                      const std::map<std::string, std::vector<float>>& weights) {
  auto stage = std::make_unique<HostStage>(c, layout, checkpointing, bfloat16);
  for (ParameterView& view : stage->parameters()) {
    std::copy_n(weights.at(view.name).data(), view.numel, view.data);
  }
  return stage;
}

Gradients host_gradients(const HostStage& stage) {
  Gradients all;
  for (const ParameterView& view : stage.parameters()) {
    all[view.name].assign(view.grad, view.grad + view.numel);
  }
  return all;
}

// Two micro-batches in flight, the second's backward split into its input
// and weight passes as a zero-bubble schedule runs them.
template <class Owned>
std::vector<double> two_microbatches(Owned& owned, const std::vector<stage_fixture::Batch>& data) {
  Stage& stage = owned.stage();
  stage.set_shape(kBatch, kSeqLen);
  std::vector<double> losses;
  for (int32_t mb = 0; mb < 2; ++mb) {
    losses.push_back(stage.forward(mb, data[size_t(mb)].tokens.data(),
                                   data[size_t(mb)].targets.data(), nullptr, nullptr));
  }
  stage.backward(0, 0.5f, nullptr, nullptr);
  stage.backward_input(1, 0.5f, nullptr, nullptr);
  stage.backward_weight(1);
  return losses;
}

TEST_CASE("model buffers: a kit stage computes in its compute's memory only, as on the host",
          "[kit][device]") {
  const std::string family = GENERATE("qwen2", "phi", "gpt2", "mixtral");
  const int checkpointing_mode = GENERATE(0, 1);
  const bool bfloat16 = GENERATE(false, true);
  CAPTURE(family, checkpointing_mode, bfloat16);
  const Composition c = composition(family);
  const auto weights = random_weights(c, 7);
  Checkpointing checkpointing;
  if (checkpointing_mode == 1) {
    checkpointing = {{0, Recomputation::selective}, {1, Recomputation::full}};
  }
  const StageLayout whole{0, kLayers, true, true};
  const std::vector<stage_fixture::Batch> data{
      stage_fixture::random_batch(kVocab, kBatch, kSeqLen, 1),
      stage_fixture::random_batch(kVocab, kBatch, kSeqLen, 2)};

  const auto host = host_stage(c, whole, checkpointing, bfloat16, weights);
  const std::vector<double> host_losses = two_microbatches(*host, data);
  FencedCompute compute;
  FencedStage fenced(c, whole, checkpointing, bfloat16, compute, weights);
  const std::vector<double> fenced_losses = two_microbatches(fenced, data);

  CHECK(fenced_losses == host_losses);
  CHECK(fenced.gradients() == host_gradients(*host));
  CHECK(compute.calls() > 100);
  CHECK(fenced.stage().activation_bytes() == host->stage().activation_bytes());
}

TEST_CASE("model buffers: pipeline stages hand hidden states over in the compute's memory",
          "[kit][device]") {
  const Composition c = composition("qwen2");
  const auto weights = random_weights(c, 3);
  const stage_fixture::Batch batch = stage_fixture::random_batch(kVocab, kBatch, kSeqLen, 5);
  const StageLayout first{0, 1, true, false}, last{1, kLayers, false, true};

  const auto host_first = host_stage(c, first, {}, false, weights);
  const auto host_last = host_stage(c, last, {}, false, weights);
  FencedCompute compute;
  FencedStage fenced_first(c, first, {}, false, compute, weights);
  FencedStage fenced_last(c, last, {}, false, compute, weights);
  for (Stage* stage :
       {&host_first->stage(), &host_last->stage(), &fenced_first.stage(), &fenced_last.stage()}) {
    stage->set_shape(kBatch, kSeqLen);
  }
  const auto numel = size_t(host_first->stage().output_numel());
  std::vector<float> hidden(numel), d_hidden(numel);
  host_first->stage().forward(0, batch.tokens.data(), nullptr, nullptr, hidden.data());
  const double host_loss =
      host_last->stage().forward(0, nullptr, batch.targets.data(), hidden.data(), nullptr);
  host_last->stage().backward(0, 1.0f, nullptr, d_hidden.data());
  host_first->stage().backward(0, 1.0f, d_hidden.data(), nullptr);

  Buffer<float> boundary(numel, compute), d_boundary(numel, compute);
  fenced_first.stage().forward(0, batch.tokens.data(), nullptr, nullptr, boundary.data());
  const double fenced_loss =
      fenced_last.stage().forward(0, nullptr, batch.targets.data(), boundary.data(), nullptr);
  fenced_last.stage().backward(0, 1.0f, nullptr, d_boundary.data());
  fenced_first.stage().backward(0, 1.0f, d_boundary.data(), nullptr);

  CHECK(fenced_loss == host_loss);
  std::vector<float> fenced_d_hidden(numel);
  compute.copy_to_host(fenced_d_hidden.data(), d_boundary.data(), int64_t(numel * 4));
  CHECK(fenced_d_hidden == d_hidden);
  CHECK(fenced_first.gradients() == host_gradients(*host_first));
  CHECK(fenced_last.gradients() == host_gradients(*host_last));
}

TEST_CASE("model buffers: the fenced compute refuses memory it did not allocate", "[device]") {
  FencedCompute compute;
  Buffer<float> own(16, compute);
  std::vector<float> host(16);
  CHECK_THROWS_WITH(compute.add(own.data(), own.data(), host.data(), 16),
                    Catch::Matchers::Contains("outside the compute's memory"));
  compute.add(own.data(), own.data(), own.data(), 16);
  CHECK(compute.mapped_bytes() > 0);
}

TEST_CASE("model buffers: a hand-written family computes on the host's compute only", "[device]") {
  FencedCompute compute;
  BindingHooks hooks;
  meshrun::llama::LlamaConfig config;
  CHECK_THROWS_WITH(meshrun::models::TransformerStage<meshrun::llama::Llama>(
                        config, {0, config.num_hidden_layers, true, true}, hooks, {}, nullptr, {},
                        {}, {}, false, compute),
                    Catch::Matchers::Contains("computes on the host's memory only"));
}

}  // namespace model_buffers_test
