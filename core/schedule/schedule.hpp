// Pipeline schedules as data (DESIGN.md "Plan"): every rank's ordered
// actions in PyTorch's vocabulary (torch.distributed.pipelining), from a
// schedule plugin or a CSV file, checked by the validator, timed by the
// simulator, drawn as SVG, and run by the executor.
//
// Files: action.cpp (strings), generate.cpp (from a schedule plugin),
// csv.cpp (pp_schedule_csv), lower.cpp (adding communication), validate.cpp,
// simulate.cpp, svg.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "plugin/loader.hpp"

namespace meshrun::schedule {

// PyTorch's _ComputationType. B is a full backward; I and W are its input
// and weight halves (zero-bubble schedules). UNSHARD, RESHARD and
// REDUCE_GRAD are a sharded data-parallel strategy's work for a stage.
enum class ActionType : int32_t {
  F,
  B,
  I,
  W,
  SEND_F,
  RECV_F,
  SEND_B,
  RECV_B,
  UNSHARD,
  RESHARD,
  REDUCE_GRAD,
};

// One action: `stage` (the global stage index) does `type` for `microbatch`
// (-1 for UNSHARD, RESHARD and REDUCE_GRAD, which concern the whole stage).
struct Action {
  int32_t stage = 0;
  ActionType type = ActionType::F;
  int32_t microbatch = -1;
  friend bool operator==(const Action&, const Action&) = default;
};

bool is_compute(ActionType type);        // F, B, I, W
bool is_communication(ActionType type);  // SEND_*, RECV_*

// PyTorch's action strings: stage, type, microbatch: "2F0", "1B3", "0I1",
// "3SEND_F2", "1RECV_B0", "0UNSHARD", "2REDUCE_GRAD".
std::string format_action(const Action& action);
// The action a string names; nullopt when it is not one.
std::optional<Action> parse_action(std::string_view text);

// A schedule: per rank, its actions in execution order. A CSV may leave
// time steps idle (nullopt); generated schedules have no idle entries.
struct Schedule {
  std::string name;
  int64_t pp = 1;               // ranks
  int64_t stages_per_rank = 1;  // v
  int64_t microbatches = 1;     // m
  std::vector<int64_t> stage_rank;  // the rank of every stage (pp * v entries)
  std::vector<std::vector<std::optional<Action>>> ranks;
  int64_t stages() const { return static_cast<int64_t>(stage_rank.size()); }
};

// Stage placement: loop (stage s on rank s mod pp) or V (rank r holds stages
// r and 2pp-1-r; two stages per rank).
std::vector<int64_t> loop_placement(int64_t pp, int64_t stages_per_rank);
std::vector<int64_t> v_placement(int64_t pp);

}  // namespace meshrun::schedule
