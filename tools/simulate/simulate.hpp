// Timing a pipeline schedule: when every action runs for given per-action
// costs, the makespan, the bubble (docs/design.md: idle time ÷ (ranks ×
// makespan)) and the activations each rank holds at its peak.
//
// Each rank runs its actions in order; a compute action starts when the rank
// is free and its input is there:
//   F of stage s        the F of stage s-1 for the microbatch (stage 0: none)
//   B or I of stage s   the B or I of stage s+1 (the last stage: none), and
//                       the stage's own F
//   W                   the I of its stage and microbatch
// An input from another rank travels `send` + `recv`. In a lowered schedule
// it comes through the RECV of the consuming stage: sends and receives are
// asynchronous, as in PyTorch's pipeline runtime, so they take no rank time;
// a SEND is issued when its rank reaches it (after its F or B/I), and the
// RECV completes `send` + `recv` after that, or when its rank posts it if
// later. In a compute-only schedule the input arrives `send` + `recv` after
// its producer ends: with the receives posted before their consumers, as
// lowering puts them, both give the same timing. UNSHARD, RESHARD and
// REDUCE_GRAD take no time. Idle CSV cells are skipped: only the order of
// actions matters.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "schedule/schedule.hpp"

namespace meshrun::schedule {

// Time per action, in any unit. The defaults are docs/design.md's: a full
// backward B costs what its halves I and W cost together; communication is
// free. `send` + `recv` is the time one transfer between ranks takes.
struct Costs {
  double F = 1, B = 1, I = 0.5, W = 0.5, send = 0, recv = 0;
  // The rank time an action of `type` takes: its cost for F, B, I and W,
  // none for the others.
  double of(ActionType type) const;
};

// "F=1,B=1,I=0.5,W=0.5" (any of F, B, I, W, send, recv; the rest keep their
// defaults). Throws meshrun::Error (INVALID_ARGUMENT) naming the bad entry
// and the valid keys; a cost must be a finite number >= 0.
Costs parse_costs(std::string_view text);

// One compute action as simulated.
struct TimedAction {
  double start = 0;
  double end = 0;
  Action action;
};

struct Simulation {
  // Per rank, its compute actions (F, B, I, W) in execution order.
  std::vector<std::vector<TimedAction>> timelines;
  double makespan = 0;
  // Per rank: makespan minus the rank's compute time (waiting for a
  // transfer is idle time).
  std::vector<double> idle;
  double bubble_fraction = 0;  // sum of idle ÷ (ranks × makespan); 0 for makespan 0
  // Per rank: the most (stage, microbatch) pairs whose F has run there and
  // whose B or I has not yet: the activations held.
  std::vector<int64_t> peak_activations;
};

// Throws meshrun::Error (INVALID_ARGUMENT) for an action outside the
// schedule's stages or microbatches, and for a schedule that cannot finish
// (naming every blocked rank, its step and the action it waits at).
Simulation simulate(const Schedule& schedule, const Costs& costs = {});

}  // namespace meshrun::schedule
