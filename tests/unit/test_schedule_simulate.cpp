// The schedule simulator (tools/simulate/simulate.hpp) and picture
// (svg.hpp): the shipped schedules' simulated bubbles against the closed
// forms of docs/design.md ("Pipelines": bubble fractions), zero-bubble schedules against
// 1F1B, peak activations, and on hand-written schedules the timing rules,
// communication costs, and the errors for schedules that cannot run.
#include <catch2/catch.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "schedule/schedule.hpp"
#include "simulate/simulate.hpp"
#include "simulate/svg.hpp"
#include "test_schedule_support.hpp"

namespace {

using Catch::Matchers::Contains;
using meshrun::schedule::Costs;
using meshrun::schedule::Schedule;
using meshrun::schedule::simulate;
using meshrun::schedule::Simulation;
using schedule_testing::schedule_of;
using schedule_testing::shipped_schedule;

// The lowered schedule of the shipped plugin `name`, as `meshrun schedule` runs it.
Schedule shipped(const std::string& name, int64_t pp, int64_t stages_per_rank,
                 int64_t microbatches) {
  return meshrun::schedule::lower(
      meshrun::schedule::generate(shipped_schedule(name), pp, stages_per_rank, microbatches));
}

// Costs for a model cut into v·p stages instead of p: each stage does 1/v
// of the work, so schedules with different v compare at equal total work.
Costs per_stage_costs(int64_t stages_per_rank) {
  const double share = 1.0 / static_cast<double>(stages_per_rank);
  return {.F = share, .B = share, .I = 0.5 * share, .W = 0.5 * share};
}

}  // namespace

TEST_CASE("simulate: gpipe and 1f1b idle share is (p-1)/(m+p-1)", "[schedule]") {
  for (const char* name : {"gpipe", "1f1b"}) {
    for (int64_t p = 1; p <= 8; ++p) {
      for (int64_t m = 1; m <= 32; ++m) {
        INFO(name << " p=" << p << " m=" << m);
        const Simulation simulation = simulate(shipped(name, p, 1, m));
        const double expected = static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
        CHECK(simulation.bubble_fraction == Approx(expected).margin(1e-9));
        CHECK(simulation.makespan == Approx(2.0 * static_cast<double>(m + p - 1)).margin(1e-9));
      }
    }
  }
}

TEST_CASE("simulate: interleaved_1f1b idle share is (p-1)/(v*m+p-1)", "[schedule]") {
  for (int64_t v = 2; v <= 3; ++v) {
    for (int64_t p = 1; p <= 8; ++p) {
      for (int64_t m = p; m <= 32; m += p) {
        INFO("v=" << v << " p=" << p << " m=" << m);
        const Simulation simulation = simulate(shipped("interleaved_1f1b", p, v, m));
        const double expected = static_cast<double>(p - 1) / static_cast<double>(v * m + p - 1);
        CHECK(simulation.bubble_fraction == Approx(expected).margin(1e-9));
      }
    }
  }
}

TEST_CASE("simulate: zero-bubble schedules finish before 1f1b", "[schedule]") {
  for (const char* name : {"interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"}) {
    for (int64_t p = 2; p <= 8; ++p) {
      // dualpipev needs m >= 2p; the others run from m = p.
      for (int64_t m = 2 * p; m <= 32; m += p) {
        INFO(name << " p=" << p << " m=" << m);
        const double one_f_one_b = simulate(shipped("1f1b", p, 1, m)).makespan;
        const double zero_bubble = simulate(shipped(name, p, 2, m), per_stage_costs(2)).makespan;
        CHECK(zero_bubble < one_f_one_b);
      }
    }
  }
}

TEST_CASE("simulate: peak activations of 1f1b and gpipe on rank 0", "[schedule]") {
  for (int64_t p = 1; p <= 8; ++p) {
    for (int64_t m = 1; m <= 16; ++m) {
      INFO("p=" << p << " m=" << m);
      CHECK(simulate(shipped("1f1b", p, 1, m)).peak_activations[0] == std::min(p, m));
      CHECK(simulate(shipped("gpipe", p, 1, m)).peak_activations[0] == m);
    }
  }
}

// Two ranks, stages 0 and 1, two microbatches; F costs 1 and B 2 below.
Schedule two_ranks_compute_only() {
  return schedule_of({{"0F0", "0F1", "", "0B0", "0B1"}, {"1F0", "1B0", "1F1", "1B1"}}, 1, 2);
}

TEST_CASE("simulate: an action waits for its input and for its rank", "[schedule]") {
  const Simulation simulation = simulate(two_ranks_compute_only(), {.F = 1, .B = 2});
  const auto starts = [&](size_t rank) {
    std::vector<double> times;
    for (const auto& timed : simulation.timelines[rank]) times.push_back(timed.start);
    return times;
  };
  // 1F1 waits for rank 1 to finish 1B0; 0B0 waits for 1B0, 0B1 for 1B1.
  CHECK(starts(0) == std::vector<double>{0, 1, 4, 7});
  CHECK(starts(1) == std::vector<double>{1, 2, 4, 5});
  CHECK(simulation.makespan == 9);
  CHECK(simulation.idle == std::vector<double>{3, 3});
  CHECK(simulation.bubble_fraction == Approx(1.0 / 3));
  CHECK(simulation.peak_activations == std::vector<int64_t>{2, 1});
}

TEST_CASE("simulate: a transfer between ranks takes send + recv", "[schedule]") {
  const Costs costs{.F = 1, .B = 2, .send = 0.25, .recv = 0.25};
  const Simulation compute_only = simulate(two_ranks_compute_only(), costs);
  CHECK(compute_only.timelines[1][0].start == 1.5);
  CHECK(compute_only.makespan == 10);
  CHECK(compute_only.idle == std::vector<double>{4, 4});
  // Lowered, the sends and receives take no rank time: the same timing.
  const Schedule lowered =
      schedule_of({{"0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"},
                   {"1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"}},
                  1, 2);
  const Simulation timed = simulate(lowered, costs);
  CHECK(timed.makespan == 10);
  CHECK(timed.idle == compute_only.idle);
  for (size_t rank = 0; rank < 2; ++rank) {
    for (size_t i = 0; i < 4; ++i) {
      CHECK(timed.timelines[rank][i].start == compute_only.timelines[rank][i].start);
    }
  }
}

TEST_CASE("simulate: lowering keeps the timing of every shipped schedule", "[schedule]") {
  const Costs costs{.send = 0.125, .recv = 0.0625};
  for (const char* name : {"gpipe", "1f1b", "interleaved_1f1b", "looped_bfs",
                           "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"}) {
    const auto& plugin = shipped_schedule(name);
    const Schedule compute =
        meshrun::schedule::generate(plugin, 4, plugin.api().schedule->stages_per_rank, 8);
    INFO(name);
    const Simulation before = simulate(compute, costs);
    const Simulation after = simulate(meshrun::schedule::lower(compute), costs);
    CHECK(after.makespan == before.makespan);
    CHECK(after.makespan > simulate(compute).makespan);
    CHECK(after.peak_activations == before.peak_activations);
  }
}

TEST_CASE("simulate: split backward and stages on one rank", "[schedule]") {
  // A V on one rank: stage 1 takes stage 0's output locally; W follows its I.
  const Schedule schedule = schedule_of({{"0F0", "1F0", "1I0", "0I0", "1W0", "0W0"}}, 2, 1, {0, 0});
  const Simulation simulation = simulate(schedule);
  CHECK(simulation.makespan == 4);
  CHECK(simulation.bubble_fraction == 0);
  CHECK(simulation.peak_activations == std::vector<int64_t>{2});
}

TEST_CASE("simulate: refuses schedules that cannot run", "[schedule]") {
  const Schedule stuck = schedule_of({{"0B0", "0F0"}, {"1F0", "1B0"}}, 1, 1);
  CHECK_THROWS_WITH(simulate(stuck), Contains("cannot finish") && Contains("'0B0'") &&
                                         Contains("'1F0'") && Contains("rank 1"));
  const Schedule outside = schedule_of({{"0F0", "0F5"}, {"1F0"}}, 1, 2);
  CHECK_THROWS_WITH(simulate(outside), Contains("0F5") && Contains("microbatch 5"));
  const Schedule no_neighbour = schedule_of({{"0RECV_F0"}, {}}, 1, 1);
  CHECK_THROWS_WITH(simulate(no_neighbour), Contains("0RECV_F0"));
  CHECK_THROWS_AS(simulate(two_ranks_compute_only(), {.F = -1}), meshrun::Error);
}

TEST_CASE("simulate: cost strings", "[schedule]") {
  const Costs costs = meshrun::schedule::parse_costs("F=2,W=0.25,send=1e-3");
  CHECK((costs.F == 2 && costs.B == 1 && costs.I == 0.5 && costs.W == 0.25));
  CHECK((costs.send == 1e-3 && costs.recv == 0));
  for (const char* bad :
       {"", "F", "F=", "F=x", "F=-1", "F=nan", "F=inf", "X=1", "F=1,,B=1", "f=1", "F=1;B=2"}) {
    INFO(bad);
    CHECK_THROWS_WITH(meshrun::schedule::parse_costs(bad),
                      Contains("F, B, I, W, send, recv") || Contains(">= 0"));
  }
}

TEST_CASE("svg: a picture of the simulation", "[schedule]") {
  Schedule schedule = two_ranks_compute_only();
  schedule.name = "a<b&c";
  const std::string svg = meshrun::schedule::to_svg(schedule, simulate(schedule));
  CHECK(svg.starts_with("<?xml"));
  CHECK(svg.ends_with("</svg>\n"));
  CHECK_THAT(svg, Contains("a&lt;b&amp;c") && Contains("rank 1") && Contains("class=\"F0\"") &&
                      Contains("<title>1B1 ") && Contains("W backward weight"));
  // Large schedules are scaled down to a bounded width and lose their numbers.
  const Schedule large = shipped("1f1b", 8, 1, 512);
  CHECK_THAT(meshrun::schedule::to_svg(large, simulate(large)), !Contains("class=\"mb\""));
}
