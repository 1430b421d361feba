// A kit model's stage on the GPU against the same stage on the host: Qwen2-,
// Phi-, GPT-2- and Mixtral-like layers (every op kind, bias and weight
// layout, learned positions, a mixture of experts with its load-balancing
// loss), with and without recomputation (selective and full), float32 and
// bfloat16 (bfloat16 matmuls, activations kept in bfloat16), two
// micro-batches in flight and a split backward, and a model split into two
// pipeline stages handing hidden states over in device memory: its
// parameters, gradients, activations and scratch all in device memory
// (tests/unit/compute_stage.hpp; on the CPU tests/unit/test_model_buffers.cpp
// proves the stage touches them through its compute only). The losses,
// every gradient and the activation bytes are compared (for the pipeline,
// the boundary's gradient too). Without a usable GPU it exits 77.
//
// Tolerance, float32: |gpu - cpu| <= 1e-4 + 1e-3 |cpu|. Each GPU kernel
// agrees with its CPU twin within 1e-5 + 1e-4 |cpu| (test_cuda_compute.cpp:
// the same roundings, sums in another order); a two-layer forward and
// backward chains about thirty of them, and with weights of spread 0.4 on
// width 8 nothing amplifies a difference by more than a few times, so ten
// times the kernels' bound leaves margin and still catches a wrong term,
// which moves a gradient by O(itself). bfloat16: 2e-3 + 3e-2 |cpu|: a value
// that lands on the other side of a bfloat16 rounding on one device (the
// GEMMs' sums in another order) differs there by one bfloat16 ulp, 2^-8 =
// 3.9e-3 of itself, and that difference flows on through the backward;
// the bound allows a few such ulps. The experts chosen must not differ:
// these weights route away from ties (a flip would show as a gradient
// mismatch, deterministically for the fixed seed).
//
// This test has compiled but never run on a GPU (docs/testing.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda/compute.hpp"
#include "compute_stage.hpp"
#include "device_buffer.hpp"
#include "numeric/gemm.hpp"
#include "usable_devices.hpp"

namespace {

using compute_stage::ComputeStage;
using compute_stage::Values;
using meshrun::models::Checkpointing;
using meshrun::models::Compute;
using meshrun::models::Recomputation;

int failures = 0;

// One configuration's stage on the host and on `gpu`, from the same
// weights and tokens.
void check_stage(Compute& gpu, const std::string& family, bool recompute, bool bfloat16) {
  namespace kernels = meshrun::kernels;
  const kernels::MatmulPrecisionScope precision(bfloat16 ? kernels::MatmulPrecision::bfloat16
                                                         : kernels::MatmulPrecision::float32);
  const auto c = compute_stage::composition(family);
  const Values weights = compute_stage::random_weights(c, 7);
  Checkpointing checkpointing;
  if (recompute) checkpointing = {{0, Recomputation::selective}, {1, Recomputation::full}};
  const meshrun::models::StageLayout whole{0, compute_stage::kLayers, true, true};
  const std::vector<compute_stage::Tokens> data{
      compute_stage::random_tokens(kit_test::kVocab, kit_test::kBatch * kit_test::kSeqLen, 1),
      compute_stage::random_tokens(kit_test::kVocab, kit_test::kBatch * kit_test::kSeqLen, 2)};
  const auto run = [&](Compute& compute, std::vector<double>& losses, Values& gradients,
                       int64_t& bytes) {
    ComputeStage stage(c, whole, checkpointing, bfloat16, compute, weights);
    losses = compute_stage::two_microbatches(stage.stage(), data, kit_test::kBatch,
                                             kit_test::kSeqLen, compute);
    gradients = stage.gradients();
    bytes = stage.stage().activation_bytes();
  };
  std::vector<double> cpu_losses, gpu_losses;
  Values cpu_gradients, gpu_gradients;
  int64_t cpu_bytes = 0, gpu_bytes = 0;
  run(meshrun::models::host_compute(), cpu_losses, cpu_gradients, cpu_bytes);
  run(gpu, gpu_losses, gpu_gradients, gpu_bytes);

  const Bound bound = bfloat16 ? Bound{2e-3, 3e-2} : Bound{1e-4, 1e-3};
  const std::string name =
      family + (recompute ? ", recomputed" : "") + (bfloat16 ? ", bfloat16" : ", float32");
  bool same = within(name + ": losses", gpu_losses, cpu_losses, bound);
  for (const auto& [parameter, expected] : cpu_gradients) {
    same =
        within(name + ": gradient of " + parameter, gpu_gradients.at(parameter), expected, bound) &&
        same;
  }
  same = same && gpu_bytes == cpu_bytes;
  std::printf("%s kit stage on the GPU as on the host: %s (losses %.7f, %.7f on the host)\n",
              same ? "PASS" : "FAIL", name.c_str(), gpu_losses[0], cpu_losses[0]);
  if (!same) ++failures;
}

// What two pipeline stages give for one micro-batch: the last stage's
// loss, the gradient handed back over the boundary, each stage's
// gradients.
struct PipelineResults {
  std::vector<double> loss;
  std::vector<float> d_hidden;
  Values first, last;
};

// A Qwen2-like model split into two stages on `compute`, the hidden states
// and their gradient handed over in its memory, as a pipeline's executor
// hands them between ranks.
PipelineResults two_stages(Compute& compute) {
  const auto c = compute_stage::composition("qwen2");
  const Values weights = compute_stage::random_weights(c, 3);
  const compute_stage::Tokens batch =
      compute_stage::random_tokens(kit_test::kVocab, kit_test::kBatch * kit_test::kSeqLen, 5);
  ComputeStage first(c, {0, 1, true, false}, {}, false, compute, weights);
  ComputeStage last(c, {1, compute_stage::kLayers, false, true}, {}, false, compute, weights);
  first.stage().set_shape(kit_test::kBatch, kit_test::kSeqLen);
  last.stage().set_shape(kit_test::kBatch, kit_test::kSeqLen);
  const auto numel = size_t(first.stage().output_numel());
  meshrun::models::Buffer<float> hidden(numel, compute), d_hidden(numel, compute);
  const compute_stage::ComputeIds tokens(batch.tokens, compute), targets(batch.targets, compute);
  first.stage().forward(0, tokens.data(), nullptr, nullptr, hidden.data());
  PipelineResults results;
  results.loss = {last.stage().forward(0, nullptr, targets.data(), hidden.data(), nullptr)};
  last.stage().backward(0, 1.0f, nullptr, d_hidden.data());
  first.stage().backward(0, 1.0f, d_hidden.data(), nullptr);
  results.d_hidden.resize(numel);
  compute.copy_to_host(results.d_hidden.data(), d_hidden.data(), int64_t(numel * sizeof(float)));
  results.first = first.gradients();
  results.last = last.gradients();
  return results;
}

// Two pipeline stages on the GPU against the same on the host, float32.
void check_pipeline_stages(Compute& gpu) {
  const PipelineResults cpu = two_stages(meshrun::models::host_compute());
  const PipelineResults on_gpu = two_stages(gpu);
  const Bound bound{1e-4, 1e-3};
  bool same = within("pipeline: loss", on_gpu.loss, cpu.loss, bound) &&
              within("pipeline: the boundary's gradient", on_gpu.d_hidden, cpu.d_hidden, bound);
  for (const auto& [gpu_values, cpu_values] :
       {std::pair{&on_gpu.first, &cpu.first}, std::pair{&on_gpu.last, &cpu.last}}) {
    for (const auto& [parameter, expected] : *cpu_values) {
      same = within("pipeline: gradient of " + parameter, gpu_values->at(parameter), expected,
                    bound) &&
             same;
    }
  }
  std::printf(
      "%s two pipeline stages on the GPU as on the host, the hidden states handed over in "
      "device memory\n",
      same ? "PASS" : "FAIL");
  if (!same) ++failures;
}

}  // namespace

int main() {
  if (!usable_cuda_devices()) return kSkip;
  cudaStream_t stream = nullptr;
  require(cudaStreamCreate(&stream), "cudaStreamCreate");
  {
    const auto gpu = meshrun::models::make_cuda_compute(0, stream);
    for (const char* family : {"qwen2", "phi", "gpt2", "mixtral"}) {
      for (const bool recompute : {false, true}) {
        for (const bool bfloat16 : {false, true}) check_stage(*gpu, family, recompute, bfloat16);
      }
    }
    check_pipeline_stages(*gpu);
  }
  cudaStreamDestroy(stream);
  std::printf("%d of the kit stage's GPU checks failed\n", failures);
  return failures == 0 ? 0 : 1;
}
