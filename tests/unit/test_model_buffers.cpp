// A kit model's stage keeps every activation, gradient and scratch buffer
// in its compute's memory and touches them only through the compute's
// calls: what lets the same stage run on a GPU. Checked on the CPU with a
// compute whose memory faults when the host touches it outside its calls
// (fenced_compute.hpp), against the host's compute: the same losses and
// gradients bit for bit (the same kernels run, in the same order).
#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/buffer.hpp"
#include "compute_stage.hpp"
#include "fenced_compute.hpp"
#include "llama/decoder.hpp"

namespace model_buffers_test {

using compute_stage::composition;
using compute_stage::ComputeStage;
using compute_stage::kLayers;
using compute_stage::random_weights;
using compute_stage::Stage;
using fenced::FencedCompute;
using meshrun::kit::Composition;
using meshrun::models::Buffer;
using meshrun::models::Checkpointing;
using meshrun::models::Recomputation;
using meshrun::models::StageLayout;

using kit_test::kBatch;
using kit_test::kSeqLen;
using kit_test::kVocab;

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
  const std::vector<compute_stage::Tokens> data{
      compute_stage::random_tokens(kVocab, kBatch * kSeqLen, 1),
      compute_stage::random_tokens(kVocab, kBatch * kSeqLen, 2)};

  ComputeStage host(c, whole, checkpointing, bfloat16, meshrun::models::host_compute(), weights);
  const std::vector<double> host_losses = compute_stage::two_microbatches(
      host.stage(), data, kBatch, kSeqLen, meshrun::models::host_compute());
  FencedCompute compute;
  ComputeStage fenced(c, whole, checkpointing, bfloat16, compute, weights);
  const std::vector<double> fenced_losses =
      compute_stage::two_microbatches(fenced.stage(), data, kBatch, kSeqLen, compute);

  CHECK(fenced_losses == host_losses);
  CHECK(fenced.gradients() == host.gradients());
  CHECK(compute.calls() > 100);
  CHECK(fenced.stage().activation_bytes() == host.stage().activation_bytes());
}

TEST_CASE("model buffers: pipeline stages hand hidden states over in the compute's memory",
          "[kit][device]") {
  const Composition c = composition("qwen2");
  const auto weights = random_weights(c, 3);
  const compute_stage::Tokens batch = compute_stage::random_tokens(kVocab, kBatch * kSeqLen, 5);
  const StageLayout first{0, 1, true, false}, last{1, kLayers, false, true};

  ComputeStage host_first(c, first, {}, false, meshrun::models::host_compute(), weights);
  ComputeStage host_last(c, last, {}, false, meshrun::models::host_compute(), weights);
  FencedCompute compute;
  ComputeStage fenced_first(c, first, {}, false, compute, weights);
  ComputeStage fenced_last(c, last, {}, false, compute, weights);
  for (Stage* stage :
       {&host_first.stage(), &host_last.stage(), &fenced_first.stage(), &fenced_last.stage()}) {
    stage->set_shape(kBatch, kSeqLen);
  }
  const auto numel = size_t(host_first.stage().output_numel());
  std::vector<float> hidden(numel), d_hidden(numel);
  host_first.stage().forward(0, batch.tokens.data(), nullptr, nullptr, hidden.data());
  const double host_loss =
      host_last.stage().forward(0, nullptr, batch.targets.data(), hidden.data(), nullptr);
  host_last.stage().backward(0, 1.0f, nullptr, d_hidden.data());
  host_first.stage().backward(0, 1.0f, d_hidden.data(), nullptr);

  Buffer<float> boundary(numel, compute), d_boundary(numel, compute);
  const compute_stage::ComputeIds tokens(batch.tokens, compute), targets(batch.targets, compute);
  fenced_first.stage().forward(0, tokens.data(), nullptr, nullptr, boundary.data());
  const double fenced_loss =
      fenced_last.stage().forward(0, nullptr, targets.data(), boundary.data(), nullptr);
  fenced_last.stage().backward(0, 1.0f, nullptr, d_boundary.data());
  fenced_first.stage().backward(0, 1.0f, d_boundary.data(), nullptr);

  CHECK(fenced_loss == host_loss);
  std::vector<float> fenced_d_hidden(numel);
  compute.copy_to_host(fenced_d_hidden.data(), d_boundary.data(), int64_t(numel * 4));
  CHECK(fenced_d_hidden == d_hidden);
  CHECK(fenced_first.gradients() == host_first.gradients());
  CHECK(fenced_last.gradients() == host_last.gradients());
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
  compute_stage::BindingHooks hooks;
  meshrun::llama::LlamaConfig config;
  CHECK_THROWS_WITH(meshrun::models::TransformerStage<meshrun::llama::Llama>(
                        config, {0, config.num_hidden_layers, true, true}, hooks, {}, nullptr, {},
                        {}, {}, false, compute),
                    Catch::Matchers::Contains("computes on the host's memory only"));
}

}  // namespace model_buffers_test
