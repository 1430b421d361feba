// A kit stage over tp ranks run as threads (threaded_stages.hpp), every
// parameter placed as the family computes it (the embedding and head
// vocabulary-parallel, attention and MLP column- then row-parallel), with
// the residual stream replicated or split by rows (sequence parallelism),
// against the one-rank stage: every rank's losses the one-rank stage's and
// each gradient the rank's piece of its gradient (a replicated one's
// whole, the stage summing a norm's over the ranks' rows under sequence
// parallelism), within 2e-5 (float32 sums split over ranks and added in
// another order). On fenced computes (memory that faults outside the
// compute's calls) the ranks give the host compute's results bit for bit:
// the tp collectives and the vocabulary-parallel loss touch the compute's
// memory through its calls only.
#include <catch2/catch.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fenced_compute.hpp"
#include "threaded_stages.hpp"

TEST_CASE("a kit stage over tp ranks computes as one rank, in its compute's memory only",
          "[kit][device]") {
  constexpr int64_t tp = 2;
  const bool sequence_parallel = GENERATE(false, true);
  CAPTURE(sequence_parallel);
  const compute_stage::Composition c = threaded_stages::qwen2_for_tp();
  const compute_stage::Values weights = compute_stage::random_weights(c, 7);
  const std::vector<compute_stage::Tokens> data = threaded_stages::two_microbatches_of_tokens();
  const threaded_stages::OneRank one = threaded_stages::one_rank(c, weights, data);

  const threaded_stages::StageResults host =
      threaded_stages::over_tp_ranks(c, tp, sequence_parallel, weights, data, {});
  for (int64_t rank = 0; rank < tp; ++rank) {
    CAPTURE(rank);
    const auto& losses = host.losses[size_t(rank)];
    REQUIRE(losses.size() == one.losses.size());
    for (size_t mb = 0; mb < losses.size(); ++mb) {
      CHECK(losses[mb] == Approx(one.losses[mb]).margin(2e-5).epsilon(2e-5));
    }
    const compute_stage::Values expected = threaded_stages::tp_pieces(c, one.gradients, rank, tp);
    REQUIRE(host.gradients[size_t(rank)].size() == expected.size());
    for (const auto& [name, values] : host.gradients[size_t(rank)]) {
      const std::vector<float>& want = expected.at(name);
      REQUIRE(values.size() == want.size());
      for (size_t i = 0; i < values.size(); ++i) {
        CAPTURE(name, i);
        CHECK(values[i] == Approx(want[i]).margin(2e-5).epsilon(2e-5));
      }
    }
  }
  const threaded_stages::StageResults fenced =
      threaded_stages::over_tp_ranks(c, tp, sequence_parallel, weights, data,
                                     [] { return std::make_shared<fenced::FencedCompute>(); });
  CHECK(fenced.losses == host.losses);
  CHECK(fenced.gradients == host.gradients);
}
