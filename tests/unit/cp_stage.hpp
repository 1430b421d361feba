// A kit model's whole stage (compute_stage.hpp) over cp ranks run as threads
// (threaded_cp.hpp), each rank's stage on a compute of its own: what the
// tests of a stage's context parallelism without MPI run, on the host's
// and fenced computes (tests/unit) and on a GPU's (tests/gpu).
#pragma once

#include <cstdint>
#include <vector>

#include "compute_stage.hpp"
#include "threaded_cp.hpp"

namespace cp_stage {

// Sequences of 8 tokens: 2 cp chunks of 2 per rank under cp 2.
constexpr int64_t kSeqLen = 8;

// Two micro-batches of kit_test::kBatch whole sequences of kSeqLen tokens.
inline std::vector<compute_stage::Tokens> two_microbatches_of_tokens() {
  const int64_t tokens = kit_test::kBatch * kSeqLen;
  return {compute_stage::random_tokens(kit_test::kVocab, tokens, 1),
          compute_stage::random_tokens(kit_test::kVocab, tokens, 2)};
}

// Each rank's losses of the two micro-batches and its gradients.
struct StageResults {
  std::vector<std::vector<double>> losses;
  std::vector<compute_stage::Values> gradients;
};

// Two micro-batches of `data` (whole sequences of kSeqLen, as every cp rank
// is handed them) through the whole-model stage of `c` in float32, over
// cp = ring x ulysses threads on the computes `make` gives.
inline StageResults over_cp_ranks(const compute_stage::Composition& c, int64_t ring,
                                  int64_t ulysses, const compute_stage::Values& weights,
                                  const std::vector<compute_stage::Tokens>& data,
                                  const threaded_cp::ComputeMaker& make) {
  const int64_t cp = ring * ulysses;
  StageResults results{std::vector<std::vector<double>>(size_t(cp)),
                       std::vector<compute_stage::Values>(size_t(cp))};
  threaded_cp::on_cp_threads(
      cp, make, [&](int64_t rank, threaded_cp::Compute& compute, threaded_cp::ThreadGroup& group) {
        const meshrun::models::StageLayout whole{0, compute_stage::kLayers, true, true};
        compute_stage::ComputeStage stage(c, whole, {}, false, compute, weights,
                                          threaded_cp::ContextParallel{&group, ring, ulysses});
        results.losses[size_t(rank)] = compute_stage::two_microbatches(
            stage.stage(), data, kit_test::kBatch, kSeqLen, compute);
        results.gradients[size_t(rank)] = stage.gradients();
      });
  return results;
}

}  // namespace cp_stage
