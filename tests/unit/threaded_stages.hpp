// A kit model's whole stage (compute_stage.hpp) over cp or ep ranks run as
// threads (threaded_ranks.hpp), each rank's stage on a compute of its own:
// what the tests of a stage's context and expert parallelism without MPI
// run, on the host's and fenced computes (tests/unit) and on a GPU's
// (tests/gpu).
#pragma once

#include <cstdint>
#include <vector>

#include "compute_stage.hpp"
#include "threaded_ranks.hpp"

namespace threaded_stages {

// Sequences of 8 tokens: 2 cp chunks of 2 per rank under cp 2.
constexpr int64_t kSeqLen = 8;

// Two micro-batches of kit_test::kBatch whole sequences of kSeqLen tokens,
// from seeds `seed` and seed + 1.
inline std::vector<compute_stage::Tokens> two_microbatches_of_tokens(uint32_t seed = 1) {
  const int64_t tokens = kit_test::kBatch * kSeqLen;
  return {compute_stage::random_tokens(kit_test::kVocab, tokens, seed),
          compute_stage::random_tokens(kit_test::kVocab, tokens, seed + 1)};
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
                                  const threaded_ranks::ComputeMaker& make) {
  const int64_t cp = ring * ulysses;
  StageResults results{std::vector<std::vector<double>>(size_t(cp)),
                       std::vector<compute_stage::Values>(size_t(cp))};
  threaded_ranks::on_threads(
      cp, make,
      [&](int64_t rank, threaded_ranks::Compute& compute, threaded_ranks::ThreadGroup& group) {
        const meshrun::models::StageLayout whole{0, compute_stage::kLayers, true, true};
        compute_stage::ComputeStage stage(c, whole, {}, false, compute, weights,
                                          threaded_ranks::ContextParallel{&group, ring, ulysses});
        results.losses[size_t(rank)] = compute_stage::two_microbatches(
            stage.stage(), data, kit_test::kBatch, kSeqLen, compute);
        results.gradients[size_t(rank)] = stage.gradients();
      });
  return results;
}

// The Mixtral-like layer with 4 experts (2 a rank under ep 2), top 2.
inline compute_stage::Composition four_experts() {
  meshrun_kit_model_spec spec = kit_test::mixtral_spec(compute_stage::kLayers, 0.02);
  spec.num_local_experts = 4;
  return meshrun::kit::compose(spec, "mixtral", nlohmann::ordered_json::object());
}

// Two micro-batches through the whole-model stage of `c` (a mixture) in
// float32 over ep threads, rank r on data[r] and the computes `make` gives,
// with expert e of E on rank e * ep / E.
inline StageResults over_ep_ranks(const compute_stage::Composition& c, int64_t ep,
                                  const compute_stage::Values& weights,
                                  const std::vector<std::vector<compute_stage::Tokens>>& data,
                                  const threaded_ranks::ComputeMaker& make) {
  StageResults results{std::vector<std::vector<double>>(size_t(ep)),
                       std::vector<compute_stage::Values>(size_t(ep))};
  threaded_ranks::on_threads(
      ep, make,
      [&](int64_t rank, threaded_ranks::Compute& compute, threaded_ranks::ThreadGroup& group) {
        const meshrun::models::StageLayout whole{0, compute_stage::kLayers, true, true};
        compute_stage::ComputeStage stage(c, whole, {}, false, compute, weights, {},
                                          meshrun::models::ExpertParallel{&group, nullptr});
        results.losses[size_t(rank)] = compute_stage::two_microbatches(
            stage.stage(), data[size_t(rank)], kit_test::kBatch, kSeqLen, compute);
        results.gradients[size_t(rank)] = stage.gradients();
      });
  return results;
}

}  // namespace threaded_stages
