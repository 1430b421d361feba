// Action strings (PyTorch's format), stage placement, and the positions
// schedule errors name.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "schedule/schedule.hpp"

namespace {

using meshrun::schedule::Action;
using meshrun::schedule::ActionType;
using meshrun::schedule::format_action;
using meshrun::schedule::parse_action;

}  // namespace

TEST_CASE("schedule actions: every type round-trips through its string", "[schedule]") {
  const std::vector<std::pair<Action, std::string>> cases = {
      {{2, ActionType::F, 0}, "2F0"},
      {{1, ActionType::B, 3}, "1B3"},
      {{0, ActionType::I, 1}, "0I1"},
      {{0, ActionType::W, 1}, "0W1"},
      {{3, ActionType::SEND_F, 2}, "3SEND_F2"},
      {{1, ActionType::RECV_F, 0}, "1RECV_F0"},
      {{12, ActionType::SEND_B, 105}, "12SEND_B105"},
      {{1, ActionType::RECV_B, 0}, "1RECV_B0"},
      {{0, ActionType::UNSHARD, -1}, "0UNSHARD"},
      {{4, ActionType::RESHARD, -1}, "4RESHARD"},
      {{2, ActionType::REDUCE_GRAD, -1}, "2REDUCE_GRAD"},
  };
  for (const auto& [action, text] : cases) {
    INFO(text);
    CHECK(format_action(action) == text);
    const auto parsed = parse_action(text);
    REQUIRE(parsed.has_value());
    CHECK(*parsed == action);
  }
}

TEST_CASE("schedule actions: strings that are not actions are refused", "[schedule]") {
  for (const char* text :
       {"", "F0", "0", "0X1", "0F", "0F-1", "-1F0", "+1F0", "0F0x", "0UNSHARD1", "0SEND_F", " 0F0",
        "0F0 ", "0f0", "99999999999F0", "0F99999999999", "0RECV_X0", "0REDUCE_GRAD0"}) {
    INFO("'" << text << "'");
    CHECK_FALSE(parse_action(text).has_value());
  }
}

TEST_CASE("schedule actions: compute and communication types", "[schedule]") {
  for (ActionType type : {ActionType::F, ActionType::B, ActionType::I, ActionType::W}) {
    CHECK(meshrun::schedule::is_compute(type));
    CHECK_FALSE(meshrun::schedule::is_communication(type));
  }
  for (ActionType type :
       {ActionType::SEND_F, ActionType::RECV_F, ActionType::SEND_B, ActionType::RECV_B}) {
    CHECK(meshrun::schedule::is_communication(type));
    CHECK_FALSE(meshrun::schedule::is_compute(type));
  }
  for (ActionType type : {ActionType::UNSHARD, ActionType::RESHARD, ActionType::REDUCE_GRAD}) {
    CHECK_FALSE(meshrun::schedule::is_compute(type));
    CHECK_FALSE(meshrun::schedule::is_communication(type));
  }
}

TEST_CASE("schedule placement: loop and V", "[schedule]") {
  CHECK(meshrun::schedule::loop_placement(3, 1) == std::vector<int64_t>{0, 1, 2});
  CHECK(meshrun::schedule::loop_placement(2, 3) == std::vector<int64_t>{0, 1, 0, 1, 0, 1});
  CHECK(meshrun::schedule::v_placement(1) == std::vector<int64_t>{0, 0});
  CHECK(meshrun::schedule::v_placement(3) == std::vector<int64_t>{0, 1, 2, 2, 1, 0});
}

TEST_CASE("schedule positions: rank and step, and the CSV cell where there is one", "[schedule]") {
  meshrun::schedule::Schedule schedule;
  schedule.pp = 2;
  CHECK(meshrun::schedule::position(schedule, 1, 4) == "rank 1 step 4");

  schedule.csv_path = "s.csv";
  // Rank 1: cells 1 and 3 of the file, an action lowering added between
  // them, and one added before the first.
  schedule.csv_columns = {{1, 2}, {0, 1, 0, 3}};
  CHECK(meshrun::schedule::position(schedule, 0, 1) == "rank 0 step 1 (s.csv row 1, column 2)");
  CHECK(meshrun::schedule::position(schedule, 1, 3) == "rank 1 step 3 (s.csv row 2, column 3)");
  CHECK(meshrun::schedule::position(schedule, 1, 2) ==
        "rank 1 step 2 (s.csv row 2, after column 1)");
  CHECK(meshrun::schedule::position(schedule, 1, 0) ==
        "rank 1 step 0 (s.csv row 2, before its first cell)");
  CHECK(meshrun::schedule::position(schedule, 1, 4) ==
        "rank 1 step 4 (s.csv row 2, column 4: the end of the row)");
}
