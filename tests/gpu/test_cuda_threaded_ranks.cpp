// Tensor, context and expert parallelism on one GPU: ring, Ulysses and
// hybrid attention over cp ranks (SequenceAttention,
// models/common/context_parallel.hpp), and a kit model's whole stage over
// tp, cp and ep ranks, with every rank on the GPU's compute against the
// same ranks on the host's. The ranks run as threads of one process, each
// with its own stream on GPU 0, their collectives moving the compute's
// memory through the host (tests/unit/threaded_ranks.hpp), so the whole tp,
// cp and ep paths — the column- and row-parallel projections and the
// vocabulary-parallel loss; the ring's block kernels, the strided copies of
// packing and Ulysses' regrouping, the gradients' travel, a stage's rows of
// the tokens, its positions and the loss's sum; the experts' dispatch and
// combine over ranks — run on one GPU, without NCCL (which refuses two
// ranks of a communicator on one GPU). Attention: ring 2 and 4 (query
// blocks of 64 and 3 on the host), Ulysses 2, ring 2 x Ulysses 2. Stages
// (tests/unit/threaded_stages.hpp, float32): a Qwen2-like layer on tp 2,
// with and without sequence parallelism;
// Qwen2- and Phi-like on ring 2, GPT-2-like on ring 2 and Ulysses 2; a
// Mixtral-like layer of 4 experts on ep 2, each rank its own tokens.
// Without a usable GPU it exits 77.
//
// Tolerance: attention |gpu - cpu| <= 1e-5 + 1e-4 |cpu| per element of
// each rank's output and q/k/v gradients, the GPU compute test's bound for
// attention (test_cuda_compute.cpp): the ring's steps are those kernels'
// sums over other blocks of keys, merged by log-sum-exp in the same order
// on both sides, with values of spread 1. Stages: the losses and every
// gradient within the kit stage test's float32 bound, 1e-4 + 1e-3 |cpu|
// (test_cuda_kit_stage.cpp, where it is justified for a two-layer forward
// and backward; tp, cp and ep change which rows and columns a rank holds
// and where an expert computes, not the chain). The experts chosen must
// be the same on both devices (a tie the two orders of summation break
// apart would show as a gradient far off).
//
// This test has compiled but never run on a GPU (docs/testing.md).
#include <cuda_runtime.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/cuda/compute.hpp"
#include "device_buffer.hpp"
#include "threaded_ranks.hpp"
#include "threaded_stages.hpp"
#include "usable_devices.hpp"

namespace {

using threaded_ranks::AttentionShape;
using threaded_ranks::RankResults;

// A GPU compute on a stream of its own, the stream destroyed with it.
std::shared_ptr<meshrun::models::Compute> gpu_compute() {
  cudaSetDevice(0);
  cudaStream_t stream = nullptr;
  if (cudaStreamCreate(&stream) != cudaSuccess) throw std::runtime_error("cudaStreamCreate failed");
  std::unique_ptr<meshrun::models::Compute> compute = meshrun::models::make_cuda_compute(0, stream);
  return {compute.release(), [stream](meshrun::models::Compute* made) {
            delete made;
            cudaStreamDestroy(stream);
          }};
}

// Whether every rank's values agree within `bound` (device_buffer.hpp's
// within, rank by rank); prints the outcome.
template <class Values>
bool agree(const std::string& what, const std::vector<Values>& gpu, const std::vector<Values>& cpu,
           Bound bound) {
  bool close = gpu.size() == cpu.size();
  for (size_t rank = 0; close && rank < cpu.size(); ++rank) {
    close = within(what + ", rank " + std::to_string(rank), gpu[rank], cpu[rank], bound);
  }
  std::printf("%s %s\n", close ? "PASS" : "FAIL", what.c_str());
  return close;
}

// Attention over cp ranks: failures.
int check_attention(const char* name, int64_t ring, int64_t ulysses, int64_t query_block) {
  const int64_t cp = ring * ulysses;
  const AttentionShape full{2, 40 * cp, 4, 2, 40, 64};
  const auto rows = size_t(full.batch * full.seq_len);
  const std::vector<float> qkv = threaded_ranks::random_values(rows * size_t(full.qkv_dim()), 1);
  const std::vector<float> d_out = threaded_ranks::random_values(rows * size_t(full.q_dim()), 2);
  const RankResults cpu =
      threaded_ranks::over_cp_ranks(full, ring, ulysses, query_block, qkv, d_out, {});
  const RankResults gpu =
      threaded_ranks::over_cp_ranks(full, ring, ulysses, query_block, qkv, d_out, gpu_compute);
  const Bound bound{1e-5, 1e-4};
  return (agree(std::string(name) + ": output", gpu.out, cpu.out, bound) ? 0 : 1) +
         (agree(std::string(name) + ": q/k/v gradients", gpu.d_qkv, cpu.d_qkv, bound) ? 0 : 1);
}

// Each rank's losses and gradients on the GPU against the host's:
// failures.
int compare_stages(const std::string& name, const threaded_stages::StageResults& gpu,
                   const threaded_stages::StageResults& cpu) {
  const Bound bound{1e-4, 1e-3};
  int failures = agree(name + ": losses", gpu.losses, cpu.losses, bound) ? 0 : 1;
  for (size_t rank = 0; rank < cpu.gradients.size(); ++rank) {
    for (const auto& [parameter, values] : cpu.gradients[rank]) {
      const auto found = gpu.gradients[rank].find(parameter);
      const std::vector<std::vector<float>> on_gpu{
          found != gpu.gradients[rank].end() ? found->second : std::vector<float>{}};
      failures += agree(name + ", rank " + std::to_string(rank) + ": gradient of " + parameter,
                        on_gpu, {values}, bound)
                      ? 0
                      : 1;
    }
  }
  return failures;
}

// A kit stage over cp ranks: failures.
int check_cp_stage(const std::string& family, int64_t ring, int64_t ulysses) {
  const compute_stage::Composition c = compute_stage::composition(family);
  const compute_stage::Values weights = compute_stage::random_weights(c, 7);
  const std::vector<compute_stage::Tokens> data = threaded_stages::two_microbatches_of_tokens();
  return compare_stages(
      family + " stage, ring " + std::to_string(ring) + " x Ulysses " + std::to_string(ulysses),
      threaded_stages::over_cp_ranks(c, ring, ulysses, weights, data, gpu_compute),
      threaded_stages::over_cp_ranks(c, ring, ulysses, weights, data, {}));
}

// A kit stage over tp 2, every parameter placed as the family computes it,
// with or without sequence parallelism: failures.
int check_tp_stage(bool sequence_parallel) {
  const compute_stage::Composition c = threaded_stages::qwen2_for_tp();
  const compute_stage::Values weights = compute_stage::random_weights(c, 7);
  const std::vector<compute_stage::Tokens> data = threaded_stages::two_microbatches_of_tokens();
  return compare_stages(
      sequence_parallel ? "qwen2 stage, tp 2, sequence parallel" : "qwen2 stage, tp 2",
      threaded_stages::over_tp_ranks(c, 2, sequence_parallel, weights, data, gpu_compute),
      threaded_stages::over_tp_ranks(c, 2, sequence_parallel, weights, data, {}));
}

// A mixture's stage over ep 2, each rank its own tokens: failures.
int check_ep_stage() {
  const compute_stage::Composition c = threaded_stages::four_experts();
  const compute_stage::Values weights = compute_stage::random_weights(c, 7);
  const std::vector<std::vector<compute_stage::Tokens>> data{
      threaded_stages::two_microbatches_of_tokens(1),
      threaded_stages::two_microbatches_of_tokens(3)};
  return compare_stages("mixtral stage, ep 2",
                        threaded_stages::over_ep_ranks(c, 2, weights, data, gpu_compute),
                        threaded_stages::over_ep_ranks(c, 2, weights, data, {}));
}

}  // namespace

int main() {
  if (!usable_cuda_devices()) return kSkip;
  int failures = 0;
  const auto counted = [&failures](const char* what, auto&& check) {
    try {
      failures += check();
    } catch (const std::exception& error) {
      std::printf("FAIL %s: %s\n", what, error.what());
      ++failures;
    }
  };
  counted("ring 2", [] { return check_attention("ring 2", 2, 1, 64); });
  counted("ring 4", [] { return check_attention("ring 4", 4, 1, 3); });
  counted("Ulysses 2", [] { return check_attention("Ulysses 2", 1, 2, 64); });
  counted("ring 2 x Ulysses 2", [] { return check_attention("ring 2 x Ulysses 2", 2, 2, 5); });
  counted("qwen2 stage", [] { return check_cp_stage("qwen2", 2, 1); });
  counted("phi stage", [] { return check_cp_stage("phi", 2, 1); });
  counted("gpt2 stage, ring", [] { return check_cp_stage("gpt2", 2, 1); });
  counted("gpt2 stage, Ulysses", [] { return check_cp_stage("gpt2", 1, 2); });
  counted("qwen2 stage, tp 2", [] { return check_tp_stage(false); });
  counted("qwen2 stage, tp 2, sequence parallel", [] { return check_tp_stage(true); });
  counted("mixtral stage, ep 2", [] { return check_ep_stage(); });
  std::printf("%d of the model-parallel checks on the GPU failed\n", failures);
  return failures == 0 ? 0 : 1;
}
