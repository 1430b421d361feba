// Ring, Ulysses and hybrid attention over cp ranks (SequenceAttention,
// models/common/context_parallel.hpp) with every rank on the GPU's compute
// against the same ranks on the host's: cp ranks run as threads of one
// process, each with its own stream on GPU 0, their all-to-alls moving the
// compute's memory through the host (tests/unit/threaded_cp.hpp), so the
// whole attention path over cp — the ring's block kernels, the strided
// copies of packing and Ulysses' regrouping, the swaps and sums of the
// gradients' travel — runs on one GPU, without NCCL (which refuses two
// ranks of a communicator on one GPU). Ring 2 and 4 (query blocks of 64 and
// 3 on the host), Ulysses 2, ring 2 x Ulysses 2. Without a usable GPU it
// exits 77.
//
// Tolerance: |gpu - cpu| <= 1e-5 + 1e-4 |cpu| per element of each rank's
// output and q/k/v gradients, the GPU compute test's bound for attention
// (test_cuda_compute.cpp): the ring's steps are those kernels' sums over
// other blocks of keys, merged by log-sum-exp in the same order on both
// sides, with values of spread 1.
//
// This test has compiled but never run on a GPU (docs/testing.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/cuda/compute.hpp"
#include "threaded_cp.hpp"
#include "usable_devices.hpp"

namespace {

using threaded_cp::AttentionShape;
using threaded_cp::RankResults;

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

// Whether every element of every rank agrees within the bound; prints the
// largest difference.
bool agree(const std::string& what, const std::vector<std::vector<float>>& gpu,
           const std::vector<std::vector<float>>& cpu) {
  double worst = 0;
  bool within = gpu.size() == cpu.size();
  for (size_t rank = 0; within && rank < cpu.size(); ++rank) {
    within = gpu[rank].size() == cpu[rank].size();
    for (size_t i = 0; within && i < cpu[rank].size(); ++i) {
      const double error = std::abs(double(gpu[rank][i]) - double(cpu[rank][i]));
      worst = std::max(worst, error);
      within = error <= 1e-5 + 1e-4 * std::abs(double(cpu[rank][i]));
    }
  }
  std::printf("%s %s (largest difference %.3g)\n", within ? "PASS" : "FAIL", what.c_str(), worst);
  return within;
}

}  // namespace

int main() {
  if (!usable_cuda_devices()) return kSkip;
  struct Case {
    const char* name;
    int64_t ring, ulysses, query_block;
  };
  int failures = 0;
  for (const Case& c : {Case{"ring 2", 2, 1, 64}, Case{"ring 4", 4, 1, 3},
                        Case{"Ulysses 2", 1, 2, 64}, Case{"ring 2 x Ulysses 2", 2, 2, 5}}) {
    const int64_t cp = c.ring * c.ulysses;
    const AttentionShape full{2, 40 * cp, 4, 2, 40, 64};
    const auto rows = size_t(full.batch * full.seq_len);
    const std::vector<float> qkv = threaded_cp::random_values(rows * size_t(full.qkv_dim()), 1);
    const std::vector<float> d_out = threaded_cp::random_values(rows * size_t(full.q_dim()), 2);
    try {
      const RankResults cpu =
          threaded_cp::over_cp_ranks(full, c.ring, c.ulysses, c.query_block, qkv, d_out, {});
      const RankResults gpu = threaded_cp::over_cp_ranks(full, c.ring, c.ulysses, c.query_block,
                                                         qkv, d_out, gpu_compute);
      failures += agree(std::string(c.name) + ": output", gpu.out, cpu.out) ? 0 : 1;
      failures += agree(std::string(c.name) + ": q/k/v gradients", gpu.d_qkv, cpu.d_qkv) ? 0 : 1;
    } catch (const std::exception& error) {
      std::printf("FAIL %s: %s\n", c.name, error.what());
      ++failures;
    }
  }
  std::printf("%d of the context-parallel attention checks failed\n", failures);
  return failures == 0 ? 0 : 1;
}
