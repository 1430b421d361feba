// Context-parallel attention (models/common/context_parallel.hpp) against
// the one-rank kernels (common/layers.hpp): cp ranks run as threads over an in-memory group,
// each computing its rows of the same sequences; its output and its rows'
// q/k/v gradients must be the whole sequence's at those rows' positions.
// float32 sums in another order (blocks merged by log-sum-exp): 2e-5.
// The same ranks on fenced computes (fenced_compute.hpp: memory the host
// cannot touch outside the compute's calls, as a GPU's) must give the host
// compute's results bit for bit: every step is a call of the compute and
// every transfer moves the compute's memory.
#include <catch2/catch.hpp>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "fenced_compute.hpp"
#include "threaded_ranks.hpp"
#include "threaded_stages.hpp"

namespace {

using threaded_ranks::AttentionShape;
using threaded_ranks::ContextParallel;
using threaded_ranks::local_rows;
using threaded_ranks::Mailboxes;
using threaded_ranks::over_cp_ranks;
using threaded_ranks::random_values;
using threaded_ranks::RankResults;
using threaded_ranks::SequenceAttention;
using threaded_ranks::SequenceShard;
using threaded_ranks::ThreadGroup;

std::shared_ptr<meshrun::models::Compute> fenced_compute() {
  return std::make_shared<fenced::FencedCompute>();
}

void check_against_one_rank(int64_t ring, int64_t ulysses, int64_t query_block) {
  const int64_t cp = ring * ulysses;
  AttentionShape full{2, 8 * cp, 4, 2, 8, 64};
  const int64_t rows = full.batch * full.seq_len;
  const std::vector<float> qkv = random_values(size_t(rows * full.qkv_dim()), 1);
  const std::vector<float> d_out = random_values(size_t(rows * full.q_dim()), 2);
  std::vector<float> out(size_t(rows * full.q_dim())), lse(size_t(full.lse_size()));
  std::vector<float> d_qkv(qkv.size());
  // One rank: the plain kernels, as the model library compiles them (a copy
  // instantiated here, with other flags, could replace the library's).
  SequenceAttention one_rank(full, ContextParallel{}, "test");
  one_rank.forward(out.data(), lse.data(), qkv.data());
  one_rank.backward(d_qkv.data(), d_out.data(), qkv.data(), out.data(), lse.data());

  const RankResults host = over_cp_ranks(full, ring, ulysses, query_block, qkv, d_out, {});
  for (int64_t rank = 0; rank < cp; ++rank) {
    const SequenceShard shard{cp, rank, full.seq_len};
    const std::vector<float> want_out = local_rows(out, shard, full.batch, full.q_dim());
    const std::vector<float> want_d_qkv = local_rows(d_qkv, shard, full.batch, full.qkv_dim());
    for (size_t i = 0; i < want_out.size(); ++i) {
      REQUIRE(host.out[size_t(rank)][i] == Approx(want_out[i]).margin(2e-5).epsilon(2e-5));
    }
    for (size_t i = 0; i < want_d_qkv.size(); ++i) {
      REQUIRE(host.d_qkv[size_t(rank)][i] == Approx(want_d_qkv[i]).margin(2e-5).epsilon(2e-5));
    }
  }
  const RankResults fenced =
      over_cp_ranks(full, ring, ulysses, query_block, qkv, d_out, fenced_compute);
  CHECK(fenced.out == host.out);
  CHECK(fenced.d_qkv == host.d_qkv);
}

}  // namespace

TEST_CASE("ring attention over cp ranks computes one rank's attention") {
  check_against_one_rank(2, 1, 64);
  check_against_one_rank(4, 1, 3);
}

// A kit stage over cp ranks as a cp run's ranks each have it, handed the
// whole micro-batch: every rank's loss is the one-rank stage's (the mean
// over all rows, summed over the group) and the mean of their gradients
// (each of the mean over the rank's rows) is its gradient, float32 sums in
// another order: 2e-5 as attention's. On fenced computes the same bits as
// on the host's: the stage's cp path (its rows of the tokens, the
// positions, attention, the loss's sum) touches the compute's memory
// through its calls only.
TEST_CASE("a kit stage over cp ranks trains as one rank, in its compute's memory only",
          "[kit][device]") {
  const auto [family, ring, ulysses] =
      GENERATE(std::tuple<std::string, int64_t, int64_t>{"qwen2", 2, 1},
               std::tuple<std::string, int64_t, int64_t>{"phi", 2, 1},
               std::tuple<std::string, int64_t, int64_t>{"gpt2", 2, 1},
               std::tuple<std::string, int64_t, int64_t>{"gpt2", 1, 2});
  CAPTURE(family, ring, ulysses);
  const compute_stage::Composition c = compute_stage::composition(family);
  const compute_stage::Values weights = compute_stage::random_weights(c, 7);
  const std::vector<compute_stage::Tokens> data = threaded_stages::two_microbatches_of_tokens();
  const threaded_stages::OneRank one = threaded_stages::one_rank(c, weights, data);

  const threaded_stages::StageResults host =
      threaded_stages::over_cp_ranks(c, ring, ulysses, weights, data, {});
  const auto ranks = double(ring * ulysses);
  for (const std::vector<double>& losses : host.losses) {
    REQUIRE(losses.size() == one.losses.size());
    for (size_t mb = 0; mb < losses.size(); ++mb) {
      CHECK(losses[mb] == Approx(one.losses[mb]).margin(2e-5).epsilon(2e-5));
    }
  }
  for (const auto& [name, expected] : one.gradients) {
    for (size_t i = 0; i < expected.size(); ++i) {
      double mean = 0;
      for (const compute_stage::Values& gradients : host.gradients) mean += gradients.at(name)[i];
      CAPTURE(name, i);
      CHECK(mean / ranks == Approx(expected[i]).margin(2e-5).epsilon(2e-5));
    }
  }
  const threaded_stages::StageResults fenced =
      threaded_stages::over_cp_ranks(c, ring, ulysses, weights, data, fenced_compute);
  CHECK(fenced.losses == host.losses);
  CHECK(fenced.gradients == host.gradients);
}

TEST_CASE("a cp rank keeps chunks i and 2 cp - 1 - i of each sequence") {
  const SequenceShard first{2, 0, 8}, second{2, 1, 8};
  CHECK(first.positions() == std::vector<int64_t>{0, 1, 6, 7});
  CHECK(second.positions() == std::vector<int64_t>{2, 3, 4, 5});
  const std::vector<int32_t> tokens{10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 24, 25, 26, 27};
  std::vector<int32_t> local(8);
  second.select(tokens.data(), local.data(), 2);
  CHECK(local == std::vector<int32_t>{12, 13, 14, 15, 22, 23, 24, 25});
}

TEST_CASE("Ulysses attention over cp ranks computes one rank's attention") {
  check_against_one_rank(1, 2, 64);
}

TEST_CASE("ring x Ulysses attention computes one rank's attention") {
  check_against_one_rank(2, 2, 5);
}

TEST_CASE("the plan's context-parallel degrees must fit the cp group") {
  Mailboxes mail;
  ThreadGroup group(mail, 4, 0);
  const ContextParallel cp = meshrun::models::plan_context_parallel(
      R"({"context_parallel": {"ring_degree": 2, "ulysses_degree": 2}})", &group, "test");
  CHECK((cp.ring_degree == 2 && cp.ulysses_degree == 2));
  CHECK(meshrun::models::plan_context_parallel("{}", &group, "test").ring_degree == 4);
  CHECK_THROWS_WITH(meshrun::models::plan_context_parallel(
                        R"({"context_parallel": {"ring_degree": 3}})", &group, "test"),
                    Catch::Contains("ring degree 3 x Ulysses degree 1 is not the cp group's 4"));
}

TEST_CASE("threaded ranks: a rank that fails ends the others, which would wait for it") {
  float value = 1.0f;
  CHECK_THROWS_WITH(
      threaded_ranks::on_threads(2, {},
                                 [&value](int64_t rank, threaded_ranks::Compute& /*compute*/,
                                          threaded_ranks::ThreadGroup& group) {
                                   if (rank == 0) throw std::runtime_error("a kernel failed");
                                   float mine = value;
                                   group.all_reduce_sum(&mine, 1);
                                 }),
      "rank 0: a kernel failed");
}
