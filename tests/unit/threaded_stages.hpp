// A kit model's whole stage (compute_stage.hpp) over tp, cp or ep ranks run as
// threads (threaded_ranks.hpp), each rank's stage on a compute of its own:
// what the tests of a stage's tensor, context and expert parallelism without MPI
// run, on the host's and fenced computes (tests/unit) and on a GPU's
// (tests/gpu).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
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

// One rank's losses and gradients: the reference.
struct OneRank {
  std::vector<double> losses;
  compute_stage::Values gradients;
};

// What a rank's stage is given: its model-parallel groups, its parameters
// (its pieces, its experts') and its two micro-batches.
struct RankStage {
  compute_stage::Parallel parallel;
  compute_stage::Values weights;
  std::vector<compute_stage::Tokens> data;
};

// Two micro-batches through each rank's whole-model stage of `c` in
// float32, over `ranks` threads on the computes `make` gives;
// given(rank, its group) says what the rank's stage is given.
template <class Given>
StageResults over_ranks(const compute_stage::Composition& c, int64_t ranks,
                        const threaded_ranks::ComputeMaker& make, Given&& given) {
  StageResults results{std::vector<std::vector<double>>(size_t(ranks)),
                       std::vector<compute_stage::Values>(size_t(ranks))};
  threaded_ranks::on_threads(
      ranks, make,
      [&](int64_t rank, threaded_ranks::Compute& compute, threaded_ranks::ThreadGroup& group) {
        const RankStage rank_stage = given(rank, group);
        const meshrun::models::StageLayout whole{0, compute_stage::kLayers, true, true};
        compute_stage::ComputeStage stage(c, whole, {}, false, compute, rank_stage.weights,
                                          rank_stage.parallel);
        results.losses[size_t(rank)] = compute_stage::two_microbatches(
            stage.stage(), rank_stage.data, kit_test::kBatch, kSeqLen, compute);
        results.gradients[size_t(rank)] = stage.gradients();
      });
  return results;
}

// Two micro-batches of `data` through the whole-model stage of `c` on the
// host's compute, in float32, without model parallelism.
inline OneRank one_rank(const compute_stage::Composition& c, const compute_stage::Values& weights,
                        const std::vector<compute_stage::Tokens>& data) {
  StageResults one = over_ranks(c, 1, {}, [&](int64_t, threaded_ranks::ThreadGroup&) {
    return RankStage{{}, weights, data};
  });
  return {std::move(one.losses[0]), std::move(one.gradients[0])};
}

// Two micro-batches of `data` (whole sequences of kSeqLen, as every cp rank
// is handed them) through the whole-model stage of `c` in float32, over
// cp = ring x ulysses threads on the computes `make` gives.
inline StageResults over_cp_ranks(const compute_stage::Composition& c, int64_t ring,
                                  int64_t ulysses, const compute_stage::Values& weights,
                                  const std::vector<compute_stage::Tokens>& data,
                                  const threaded_ranks::ComputeMaker& make) {
  return over_ranks(c, ring * ulysses, make, [&](int64_t, threaded_ranks::ThreadGroup& group) {
    RankStage given{{}, weights, data};
    given.parallel.cp = threaded_ranks::ContextParallel{&group, ring, ulysses};
    return given;
  });
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
  return over_ranks(c, ep, make, [&](int64_t rank, threaded_ranks::ThreadGroup& group) {
    RankStage given{{}, weights, data[size_t(rank)]};
    given.parallel.ep = meshrun::models::ExpertParallel{&group, nullptr};
    return given;
  });
}

// A Qwen2-like layer whose heads, key/value heads, MLP and vocabulary all
// divide by tp 2 (2 heads, 2 key/value heads, a vocabulary of 12).
inline compute_stage::Composition qwen2_for_tp() {
  meshrun_kit_model_spec spec = kit_test::base_spec(compute_stage::kLayers);
  spec.ops = kit_test::kQwen2Layer;
  spec.num_ops = 6;
  spec.num_key_value_heads = 2;
  spec.vocab_size = 12;
  return meshrun::kit::compose(spec, "qwen2", nlohmann::ordered_json::object());
}

// Every parameter placed as the family computes it over tp ranks.
inline meshrun::models::Placements family_placements(const compute_stage::Composition& c) {
  meshrun::models::Placements placements;
  for (const auto& view : compute_stage::Composed::parameters(c)) {
    placements.of[view.name] = view.tp;
  }
  return placements;
}

// Tp rank `rank`'s piece of each of `full`'s parameters as the family
// places it (ParameterView::tp): "shard(d)" the rank's 1/tp of dimension
// d, "shard(d,b)" of each of b equal blocks of it; "replicate" all.
inline compute_stage::Values tp_pieces(const compute_stage::Composition& c,
                                       const compute_stage::Values& full, int64_t rank,
                                       int64_t tp) {
  compute_stage::Values pieces;
  for (const auto& view : compute_stage::Composed::parameters(c)) {
    const std::vector<float>& values = full.at(view.name);
    if (view.tp == "replicate") {
      pieces[view.name] = values;
      continue;
    }
    const auto d = size_t(view.tp[6] - '0');
    const size_t comma = view.tp.find(',');
    const int64_t blocks = comma == std::string::npos ? 1 : std::stoll(view.tp.substr(comma + 1));
    int64_t outer = 1, inner = 1;
    for (size_t i = 0; i < view.shape.size(); ++i) {
      if (i < d) outer *= view.shape[i];
      if (i > d) inner *= view.shape[i];
    }
    const int64_t block = view.shape[d] / blocks, piece = block / tp;
    std::vector<float>& out = pieces[view.name];
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t k = 0; k < blocks; ++k) {
        const float* from = values.data() + (o * view.shape[d] + k * block + rank * piece) * inner;
        out.insert(out.end(), from, from + piece * inner);
      }
    }
  }
  return pieces;
}

// Two micro-batches of `data` through the whole-model stage of `c` in
// float32 over tp threads, every parameter placed as the family computes
// it (from `weights`, whole), the residual stream's rows split over the
// ranks with `sequence_parallel`, on the computes `make` gives.
inline StageResults over_tp_ranks(const compute_stage::Composition& c, int64_t tp,
                                  bool sequence_parallel, const compute_stage::Values& weights,
                                  const std::vector<compute_stage::Tokens>& data,
                                  const threaded_ranks::ComputeMaker& make) {
  return over_ranks(c, tp, make, [&](int64_t rank, threaded_ranks::ThreadGroup& group) {
    RankStage given{{}, tp_pieces(c, weights, rank, tp), data};
    given.parallel.tp = &group;
    given.parallel.placements = family_placements(c);
    given.parallel.placements.sequence_parallel = sequence_parallel;
    return given;
  });
}

}  // namespace threaded_stages
