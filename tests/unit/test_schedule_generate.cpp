// The shipped schedule plugins through generate(): every schedule over a
// grid of sizes lowers and validates with the right counts, small ones
// match PyTorch's order exactly, sizes a schedule cannot take are refused
// naming the constraint, and a large pipeline is generated fast.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <string>
#include <vector>

#include "test_schedule_support.hpp"

namespace {

using Catch::Contains;
using meshrun::schedule::ActionType;
using meshrun::schedule::generate;
using meshrun::schedule::lower;
using meshrun::schedule::Schedule;
using meshrun::schedule::validate;
using schedule_testing::error_of;
using schedule_testing::shipped_schedule;
using schedule_testing::Strings;
using schedule_testing::strings_of;

// The stages per rank each schedule is tried with, and whether it takes
// (pp, microbatches) by its documented rule.
struct ScheduleRule {
  const char* name;
  std::vector<int64_t> stages_per_rank;
  bool (*accepts)(int64_t pp, int64_t microbatches);
  bool split_backward;  // I and W, never B (dualpipev mixes both)
};

bool any_size(int64_t, int64_t) { return true; }
// PyTorch's rounds of at most pp microbatches, all equally long.
bool whole_rounds(int64_t pp, int64_t m) { return m % std::max<int64_t>(1, m / pp) == 0; }
bool one_per_stage(int64_t pp, int64_t m) { return m >= 2 * pp; }

const std::vector<ScheduleRule> kRules = {
    {"gpipe", {1}, &any_size, false},
    {"1f1b", {1}, &any_size, false},
    {"interleaved_1f1b", {1, 2, 3}, &whole_rounds, false},
    {"looped_bfs", {1, 2, 3}, &any_size, false},
    {"interleaved_zero_bubble", {1, 2, 3}, &whole_rounds, true},
    {"zbv_zero_bubble", {2}, &any_size, true},
    {"dualpipev", {2}, &one_per_stage, false},
};

// Per stage, how many of each action type the schedule holds.
std::vector<std::vector<int64_t>> counts_per_stage(const Schedule& schedule) {
  std::vector<std::vector<int64_t>> counts(static_cast<size_t>(schedule.stages()),
                                           std::vector<int64_t>(11, 0));
  for (const auto& list : schedule.ranks) {
    for (const auto& action : list) {
      ++counts[static_cast<size_t>(action->stage)][static_cast<size_t>(action->type)];
    }
  }
  return counts;
}

// The counts every lowered schedule has: F m times per stage, B or I+W m
// times, and m sends and m receives each way across every rank boundary.
void check_counts(const Schedule& lowered, bool split_backward) {
  const auto counts = counts_per_stage(lowered);
  const int64_t m = lowered.microbatches;
  const auto count = [&](int64_t stage, ActionType type) {
    return counts[static_cast<size_t>(stage)][static_cast<size_t>(type)];
  };
  for (int64_t stage = 0; stage < lowered.stages(); ++stage) {
    INFO("stage " << stage);
    CHECK(count(stage, ActionType::F) == m);
    CHECK(count(stage, ActionType::I) == count(stage, ActionType::W));
    CHECK(count(stage, ActionType::B) + count(stage, ActionType::I) == m);
    if (split_backward) CHECK(count(stage, ActionType::B) == 0);
    const bool next_elsewhere =
        stage + 1 < lowered.stages() && lowered.stage_rank[static_cast<size_t>(stage + 1)] !=
                                            lowered.stage_rank[static_cast<size_t>(stage)];
    CHECK(count(stage, ActionType::SEND_F) == (next_elsewhere ? m : 0));
    CHECK(count(stage, ActionType::RECV_B) == (next_elsewhere ? m : 0));
    const bool previous_elsewhere =
        stage > 0 && lowered.stage_rank[static_cast<size_t>(stage - 1)] !=
                         lowered.stage_rank[static_cast<size_t>(stage)];
    CHECK(count(stage, ActionType::RECV_F) == (previous_elsewhere ? m : 0));
    CHECK(count(stage, ActionType::SEND_B) == (previous_elsewhere ? m : 0));
  }
}

}  // namespace

TEST_CASE("schedule plugins: every schedule validates after lowering, for p 1..8 and m 1..32",
          "[schedule][plugins]") {
  for (const ScheduleRule& rule : kRules) {
    const auto& plugin = shipped_schedule(rule.name);
    for (const int64_t v : rule.stages_per_rank) {
      for (int64_t pp = 1; pp <= 8; ++pp) {
        for (int64_t m = 1; m <= 32; ++m) {
          INFO(rule.name << " pp " << pp << " v " << v << " m " << m);
          if (!rule.accepts(pp, m)) {
            CHECK_THAT(error_of([&] { generate(plugin, pp, v, m); }),
                       Contains(std::string(rule.name) + " needs"));
            continue;
          }
          const Schedule compute = generate(plugin, pp, v, m);
          CHECK(compute.name == rule.name);
          const Schedule lowered = lower(compute);
          validate(lowered);
          check_counts(lowered, rule.split_backward);
        }
      }
    }
  }
}

TEST_CASE("schedule plugins: placement is loop, or V for zbv and dualpipev",
          "[schedule][plugins]") {
  CHECK(generate(shipped_schedule("interleaved_1f1b"), 3, 2, 3).stage_rank ==
        std::vector<int64_t>{0, 1, 2, 0, 1, 2});
  CHECK(generate(shipped_schedule("zbv_zero_bubble"), 3, 2, 3).stage_rank ==
        std::vector<int64_t>{0, 1, 2, 2, 1, 0});
  CHECK(generate(shipped_schedule("dualpipev"), 2, 2, 4).stage_rank ==
        std::vector<int64_t>{0, 1, 1, 0});
}

TEST_CASE("schedule plugins: small schedules in PyTorch's order", "[schedule][plugins]") {
  CHECK(strings_of(generate(shipped_schedule("gpipe"), 2, 1, 2)) ==
        Strings{{"0F0", "0F1", "0B0", "0B1"}, {"1F0", "1F1", "1B0", "1B1"}});
  CHECK(strings_of(generate(shipped_schedule("1f1b"), 2, 1, 4)) ==
        Strings{{"0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"},
                {"1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"}});
  CHECK(strings_of(generate(shipped_schedule("looped_bfs"), 2, 2, 2)) ==
        Strings{{"0F0", "0F1", "2F0", "2F1", "2B1", "2B0", "0B1", "0B0"},
                {"1F0", "1F1", "3F0", "3F1", "3B1", "3B0", "1B1", "1B0"}});
  // Rounds of 2 microbatches: rank 0 warms up with 4 forwards (a round on
  // each local stage, 2 more per hop to the last rank), rank 1 with 2.
  CHECK(strings_of(generate(shipped_schedule("interleaved_1f1b"), 2, 2, 4)) ==
        Strings{{"0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2", "0B0", "2F3", "0B1",
                 "2B2", "2B3", "0B2", "0B3"},
                {"1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1F2", "1B0", "1F3", "1B1", "3F2", "3B2",
                 "3F3", "3B3", "1B2", "1B3"}});
  CHECK(strings_of(generate(shipped_schedule("zbv_zero_bubble"), 2, 2, 4)) ==
        Strings{
            {"0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "3I1", "3W1", "0F3", "0I0", "0W0",
             "3F2", "3I2", "3W2", "0I1", "0W1", "3F3", "3I3", "3W3", "0I2", "0W2", "0I3", "0W3"},
            {"1F0", "2F0", "1F1", "2F1", "2I0", "2W0", "1F2", "1I0", "1W0", "2F2", "2I1", "2W1",
             "1F3", "1I1", "1W1", "2F3", "2I2", "2W2", "1I2", "2I3", "1I3", "1W2", "2W3", "1W3"}});
  // PyTorch's OVERLAP_F_B pairs written out as F then B.
  CHECK(strings_of(generate(shipped_schedule("dualpipev"), 2, 2, 4)) ==
        Strings{{"0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "0F3", "3B1", "3F2", "0B0", "3B2",
                 "3F3", "0B1", "3B3", "0I2", "0W2", "0I3", "0W3"},
                {"1F0", "2F0", "1F1", "2F1", "1F2", "2B0", "2F2", "1B0", "1F3", "2B1", "2F3", "1B1",
                 "2B2", "1B2", "2I3", "1I3", "2W3", "1W3"}});
}

TEST_CASE("schedule lowering: sends after the producer, receives placed with their send",
          "[schedule][plugins]") {
  // PyTorch's _add_send_recv on 1F1B, pp 2, m 2: rank 1's receive of
  // microbatch 1 is placed when rank 0 sends it, before rank 1's 1B0.
  CHECK(strings_of(lower(generate(shipped_schedule("1f1b"), 2, 1, 2))) ==
        Strings{{"0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"},
                {"1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"}});
  // The V's turn at the last rank passes activations locally.
  const Schedule v = lower(generate(shipped_schedule("zbv_zero_bubble"), 2, 2, 2));
  for (const auto& list : strings_of(v)) {
    for (const std::string& action : list) {
      CHECK(action.find("1SEND_F") == std::string::npos);
      CHECK(action.find("2SEND_B") == std::string::npos);
    }
  }
}

TEST_CASE("schedule plugins: sizes a schedule cannot take are refused, naming the constraint",
          "[schedule][plugins]") {
  const auto refused = [](const char* name, int64_t pp, int64_t v, int64_t m,
                          const std::string& options = "{}") {
    return error_of([&] { generate(shipped_schedule(name), pp, v, m, options); });
  };
  CHECK_THAT(refused("gpipe", 2, 2, 4),
             Contains("meshrun_schedule_gpipe.so: generate: gpipe needs stages_per_rank == 1 "
                      "(one stage per rank), got 2"));
  CHECK_THAT(refused("1f1b", 2, 3, 4), Contains("1f1b needs stages_per_rank == 1"));
  CHECK_THAT(refused("zbv_zero_bubble", 2, 3, 4),
             Contains("zbv_zero_bubble needs stages_per_rank == 2 (V placement), got 3"));
  CHECK_THAT(refused("dualpipev", 2, 1, 4), Contains("dualpipev needs stages_per_rank == 2"));
  CHECK_THAT(refused("dualpipev", 4, 2, 7),
             Contains("dualpipev needs at least as many microbatches as stages (2 * pp = 8), "
                      "got 7"));
  CHECK_THAT(refused("interleaved_1f1b", 4, 2, 9),
             Contains("interleaved_1f1b needs microbatches to be a multiple of the number of "
                      "rounds max(1, microbatches / pp) = 2, got microbatches 9 with pp 4"));
  CHECK_THAT(refused("1f1b", 0, 1, 4), Contains("pp must be at least 1, got 0"));
  CHECK_THAT(refused("1f1b", 2, 1, -1), Contains("microbatches must be at least 1, got -1"));
  CHECK_THAT(refused("1f1b", 2, 1, 4, "[1]"), Contains("options_json must be a JSON object"));
  CHECK_THAT(refused("1f1b", 2, 1, 4, "{"), Contains("options_json is not JSON"));
  CHECK_THAT(refused("1f1b", int64_t{1} << 40, 1, 4), Contains("must each be at most"));
}

TEST_CASE("schedule plugins: a table without generate is UNIMPLEMENTED, naming the plugin",
          "[schedule][plugins]") {
  // An ABI 1.0 table: struct_size ends before `generate`.
  meshrun_schedule_api schedule_table{};
  schedule_table.struct_size = MESHRUN_SCHEDULE_API_SIZE_1_0;
  schedule_table.stages_per_rank = 1;
  schedule_table.placement = MESHRUN_PLACEMENT_LOOP;
  meshrun_plugin_api table{};
  table.struct_size = sizeof table;
  table.kind = MESHRUN_PLUGIN_KIND_SCHEDULE;
  table.name = "old";
  table.schedule = &schedule_table;
  const meshrun::PluginLibrary old(nullptr, &table, "plugins/meshrun_schedule_old.so");
  CHECK_THAT(error_of([&] { generate(old, 2, 1, 4); }, MESHRUN_UNIMPLEMENTED),
             Contains("schedule plugin old (plugins/meshrun_schedule_old.so) cannot generate "
                      "actions"));
}
