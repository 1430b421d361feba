// Pipeline schedules as data (docs/design.md, "The runtime"): every rank's ordered
// actions in PyTorch's vocabulary (torch.distributed.pipelining; the actions
// themselves are meshrun/schedule.hpp's, shared with the schedule plugins),
// from a schedule plugin or a CSV file, checked by the validator and run by
// the executor; tools/simulate times and draws them.
//
// Files: action.cpp (placement, positions), generate.cpp (from a schedule
// plugin), csv.cpp (pp_schedule_csv), lower.cpp (adding communication and
// sharding actions), validate.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshrun/schedule.hpp"
#include "plugin/loader.hpp"

namespace meshrun::schedule {

// A schedule: per rank, its actions in execution order. A CSV may leave
// time steps idle (nullopt); generated schedules have no idle entries.
struct Schedule {
  std::string name;
  int64_t pp = 1;                   // ranks
  int64_t stages_per_rank = 1;      // v
  int64_t microbatches = 1;         // m
  std::vector<int64_t> stage_rank;  // the rank of every stage (pp * v entries)
  std::vector<std::vector<std::optional<Action>>> ranks;
  // Set by read_csv, so that errors point into the file: its path, and for
  // every entry of `ranks` the 1-based column of its cell (0 for an action
  // that lowering or add_sharding_actions added). Rank r is row r + 1.
  // Empty for schedules that did not come from a file.
  std::string csv_path;
  std::vector<std::vector<int64_t>> csv_columns;
  int64_t stages() const { return static_cast<int64_t>(stage_rank.size()); }
};

// Stage placement: loop (stage s on rank s mod pp) or V (rank r holds stages
// r and 2pp-1-r; two stages per rank).
std::vector<int64_t> loop_placement(int64_t pp, int64_t stages_per_rank);
std::vector<int64_t> v_placement(int64_t pp);

// Where entry `step` of rank `rank` is, for error messages: "rank 1 step 4",
// plus " (FILE row 2, column 5)" for a schedule read from a CSV file. `step`
// may be one past the rank's last entry ("the end of the rank's list").
std::string position(const Schedule& schedule, int64_t rank, int64_t step);

// The compute-only schedule of a schedule plugin (meshrun/schedule.h, ABI
// 1.4) for `pp` ranks, `stages_per_rank` stages each and `microbatches`
// microbatches, placed as the plugin's table says; `options_json` is passed
// to the plugin. Lower it to run it. Throws meshrun::Error: the plugin's own
// error (INVALID_ARGUMENT naming the constraint the sizes break), prefixed
// with the plugin file; UNIMPLEMENTED naming the plugin when its table has no
// generate entry (an ABI 1.0 table); INTERNAL when it returns something that
// is not a valid compute schedule.
Schedule generate(const PluginLibrary& schedule_plugin, int64_t pp, int64_t stages_per_rank,
                  int64_t microbatches, const std::string& options_json = "{}");

// The schedule of a CSV file in PyTorch's format (pp_schedule_csv): one row
// per rank, one cell per time step, an empty cell idle. A file with no SEND
// or RECV action is taken as compute order and lowered (its idle cells
// dropped); one with communication is taken as written. Either way the
// result has passed validate(). The placement is read from the file (the
// rank whose row holds a stage's actions). Throws meshrun::Error
// INVALID_ARGUMENT naming the file, the row and column (1-based) and what is
// wrong; NOT_FOUND when the file cannot be read.
Schedule read_csv(const std::string& path, int64_t pp, int64_t stages_per_rank,
                  int64_t microbatches);

// Adds the communication to a compute-only schedule, as PyTorch's
// _add_send_recv does: every action that feeds a stage on another rank is
// followed by its send (F by SEND_F, B or I by SEND_B), and the matching
// receive goes into the receiving rank's list at that same point of a global
// order of all ranks' actions, hence before the compute that consumes it.
// Executed with blocking sends and receives, such a schedule cannot
// deadlock. Adjacent stages on one rank (the turn of a V at the last rank)
// hand activations over locally, without communication. Idle entries are
// dropped. Throws meshrun::Error INVALID_ARGUMENT when the schedule is not
// a valid compute schedule (see validate_compute), when it already holds
// communication, or when its compute order cannot run (a cycle of ranks each
// waiting for another; the message names each rank's waiting action).
Schedule lower(const Schedule& compute_only);

// What FSDP2 on the dp axis does around a stage's compute: UNSHARD of a
// stage right before its first compute action on the rank, REDUCE_GRAD right
// after its last B or W, RESHARD right after its last compute action (after
// the REDUCE_GRAD). Works on compute-only and lowered schedules.
Schedule add_sharding_actions(const Schedule& schedule);

// Checks a compute-only schedule (no SEND or RECV; UNSHARD, RESHARD and
// REDUCE_GRAD may be there), as it must be before lowering: sizes and placement agree (every
// stage's actions on the rank stage_rank names), every stage runs F exactly once per microbatch and
// B, or I and W, exactly once; B and I after their F, W after its I; a stage
// whose neighbour is on the same rank waits for that neighbour's work
// earlier in the list. Throws meshrun::Error INVALID_ARGUMENT naming the rank
// and step (and CSV row and column) of the first offending action; a missing
// action is reported at the end of the list of the rank that should run it.
void validate_compute(const Schedule& schedule);

// Checks a complete schedule: validate_compute, plus the communication:
// every SEND_F/RECV_F/SEND_B/RECV_B is on the rank of its stage and needed
// (the neighbour stage is on another rank), a send follows the compute that
// produces it, a receive precedes the compute that consumes it, every
// needed transfer is sent and received exactly once, the sharding actions
// keep every compute inside UNSHARD..RESHARD with REDUCE_GRAD once after
// the stage's last B or W; and, run with blocking sends and receives matched
// in order between each pair of ranks, the schedule finishes (else the
// message names the cycle of ranks waiting on each other, or the send and
// receive that two ranks would pair in the wrong order). Throws
// meshrun::Error INVALID_ARGUMENT naming the rank and step (and CSV row and
// column).
void validate(const Schedule& schedule);

}  // namespace meshrun::schedule
