// `meshrun trace summary`: what a profiled run's trace.json (core/trace)
// says about each rank.
#pragma once

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

namespace meshrun::trace {

// Per rank of a trace: the seconds its steps took, and their shares:
// exposed communication (comm spans), idle (idle spans) and compute (the
// rest of the steps). Validation, checkpoints and logging between steps
// are left out.
struct RankShares {
  int64_t rank = 0;
  int64_t steps = 0;
  double seconds = 0;
  double compute = 0, comm = 0, idle = 0;
};

// Reads a trace.json as Trace::write writes it. Throws std::invalid_argument
// naming what is missing for anything else.
std::vector<RankShares> summarize_trace(const nlohmann::json& trace);

}  // namespace meshrun::trace
