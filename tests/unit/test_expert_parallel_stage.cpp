// A kit mixture's stage over ep ranks run as threads (threaded_stages.hpp):
// expert parallelism changes where an expert computes, not what a rank's
// tokens give. Rank r's losses and its non-expert gradients must be those
// of the one-rank stage (every expert local) on rank r's tokens, and an
// expert's gradient on its owner the sum over the ranks' one-rank stages'
// (each rank's tokens reach it through the all-to-alls), within 2e-5: the
// same float32 sums, the experts' GEMMs over the rows of both ranks at
// once. On fenced computes (memory that faults outside the compute's
// calls) the ranks give the host compute's results bit for bit: dispatch,
// the all-to-alls and combine touch the compute's memory through its calls
// only.
#include <catch2/catch.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fenced_compute.hpp"
#include "threaded_stages.hpp"

namespace {

using compute_stage::Values;

bool is_expert(const std::string& name) { return name.find(".experts.") != std::string::npos; }

}  // namespace

TEST_CASE(
    "a kit stage over ep ranks computes its ranks' tokens as one rank, in its compute's "
    "memory only",
    "[kit][device]") {
  constexpr int64_t ep = 2;
  const compute_stage::Composition c = threaded_stages::four_experts();
  const Values weights = compute_stage::random_weights(c, 7);
  const std::vector<std::vector<compute_stage::Tokens>> data{
      threaded_stages::two_microbatches_of_tokens(1),
      threaded_stages::two_microbatches_of_tokens(3)};
  std::vector<threaded_stages::OneRank> alone;
  for (const auto& tokens : data) alone.push_back(threaded_stages::one_rank(c, weights, tokens));

  const threaded_stages::StageResults host =
      threaded_stages::over_ep_ranks(c, ep, weights, data, {});
  size_t experts_held = 0;
  for (int64_t rank = 0; rank < ep; ++rank) {
    CAPTURE(rank);
    const auto& losses = host.losses[size_t(rank)];
    REQUIRE(losses.size() == alone[size_t(rank)].losses.size());
    for (size_t mb = 0; mb < losses.size(); ++mb) {
      CHECK(losses[mb] == Approx(alone[size_t(rank)].losses[mb]).margin(2e-5).epsilon(2e-5));
    }
    for (const auto& [name, values] : host.gradients[size_t(rank)]) {
      experts_held += is_expert(name) ? 1 : 0;
      for (size_t i = 0; i < values.size(); ++i) {
        double expected = 0;
        for (int64_t r = 0; r < ep; ++r) {
          if (is_expert(name) || r == rank) expected += alone[size_t(r)].gradients.at(name)[i];
        }
        CAPTURE(name, i);
        CHECK(values[i] == Approx(expected).margin(2e-5).epsilon(2e-5));
      }
    }
  }
  size_t experts = 0;
  for (const auto& [name, values] : alone[0].gradients) experts += is_expert(name) ? 1 : 0;
  CHECK(experts_held == experts);  // each expert's parameters on one rank

  const threaded_stages::StageResults fenced = threaded_stages::over_ep_ranks(
      c, ep, weights, data, [] { return std::make_shared<fenced::FencedCompute>(); });
  CHECK(fenced.losses == host.losses);
  CHECK(fenced.gradients == host.gradients);
}
