// What the schedule tests share: the shipped schedule plugins, schedules
// written as action strings, and the message of the error a call throws.
#pragma once

#include <catch2/catch.hpp>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "errors.hpp"
#include "plugin/loader.hpp"
#include "schedule/schedule.hpp"

namespace schedule_testing {

using Strings = std::vector<std::vector<std::string>>;

// A shipped schedule plugin from this build's plugin folder, loaded once.
inline const meshrun::PluginLibrary& shipped_schedule(const std::string& name) {
  static std::map<std::string, std::shared_ptr<meshrun::PluginLibrary>> loaded;
  auto& library = loaded[name];
  if (!library) {
    library = meshrun::PluginLoader({MESHRUN_SHIPPED_PLUGIN_DIR})
                  .load(meshrun::PluginKind::schedule, name);
  }
  return *library;
}

// Every rank's actions as strings ("" for an idle step).
inline Strings strings_of(const meshrun::schedule::Schedule& schedule) {
  Strings ranks;
  for (const auto& list : schedule.ranks) {
    ranks.emplace_back();
    for (const auto& action : list) {
      ranks.back().push_back(action ? meshrun::schedule::format_action(*action) : "");
    }
  }
  return ranks;
}

// A schedule of the given actions ("" idle) and placement.
inline meshrun::schedule::Schedule schedule_of(const Strings& ranks, int64_t stages_per_rank,
                                               int64_t microbatches,
                                               std::vector<int64_t> stage_rank = {}) {
  meshrun::schedule::Schedule schedule;
  schedule.name = "test";
  schedule.pp = static_cast<int64_t>(ranks.size());
  schedule.stages_per_rank = stages_per_rank;
  schedule.microbatches = microbatches;
  schedule.stage_rank = stage_rank.empty()
                            ? meshrun::schedule::loop_placement(schedule.pp, stages_per_rank)
                            : std::move(stage_rank);
  for (const auto& list : ranks) {
    schedule.ranks.emplace_back();
    for (const std::string& text : list) {
      if (text.empty()) {
        schedule.ranks.back().push_back(std::nullopt);
        continue;
      }
      const auto action = meshrun::schedule::parse_action(text);
      REQUIRE(action.has_value());
      schedule.ranks.back().push_back(action);
    }
  }
  return schedule;
}

// The message of the meshrun::Error `call` throws, after checking its code.
template <class Call>
std::string error_of(Call call, int32_t code = MESHRUN_INVALID_ARGUMENT) {
  try {
    call();
  } catch (const meshrun::Error& error) {
    CHECK(error.code() == code);
    return error.what();
  }
  FAIL("no error thrown");
  return {};
}

}  // namespace schedule_testing
