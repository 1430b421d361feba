// Lowering a compute-only schedule to one that runs: the sends and receives
// between ranks (PyTorch's _add_send_recv), and the sharding actions of
// FSDP2 on the dp axis.
#include <fmt/format.h>

#include <cstdint>

#include "errors.hpp"
#include "schedule/schedule.hpp"

namespace meshrun::schedule {
namespace {

// What lowering has placed, per (stage, microbatch), as bits.
enum Placed : uint8_t {
  kPlacedForward = 1 << 0,
  kPlacedBackward = 1 << 1,  // B or I: the gradient for the previous stage exists
  kPlacedReceivedForward = 1 << 2,
  kPlacedReceivedBackward = 1 << 3,
};

// Takes the ranks' compute actions in rounds, rank 0 first, each rank its
// next action once that action's input exists. Placing an action whose
// output goes to another rank appends its send to this rank and the
// matching receive to the other: the receive lands in that rank's list at
// the same point of the global order as the send, so every send meets its
// receive and blocking transfers cannot deadlock.
class Lowering {
 public:
  explicit Lowering(const Schedule& in)
      : in_(in),
        next_(static_cast<size_t>(in.pp), 0),
        placed_(static_cast<size_t>(in.stages() * in.microbatches), 0) {
    out_ = in;
    for (auto& list : out_.ranks) list.clear();
    for (auto& columns : out_.csv_columns) columns.clear();
  }

  Schedule run() {
    while (true) {
      bool progress = false;
      bool remaining = false;
      for (int64_t rank = 0; rank < in_.pp; ++rank) {
        if (!skip_idle(rank)) continue;
        remaining = true;
        const Action& action = head(rank);
        if (!ready(rank, action)) continue;
        place(rank, action, column(rank));
        ++next_[static_cast<size_t>(rank)];
        progress = true;
      }
      if (!remaining) return std::move(out_);
      if (!progress) report_stuck();
    }
  }

 private:
  // Moves past idle entries; false when the rank has nothing left.
  bool skip_idle(int64_t rank) {
    const auto& list = in_.ranks[static_cast<size_t>(rank)];
    size_t& next = next_[static_cast<size_t>(rank)];
    while (next < list.size() && !list[next]) ++next;
    return next < list.size();
  }
  const Action& head(int64_t rank) const {
    return *in_.ranks[static_cast<size_t>(rank)][next_[static_cast<size_t>(rank)]];
  }
  int64_t column(int64_t rank) const {
    if (in_.csv_columns.empty()) return 0;
    return in_.csv_columns[static_cast<size_t>(rank)][next_[static_cast<size_t>(rank)]];
  }
  uint8_t& placed(int64_t stage, int64_t microbatch) {
    return placed_[static_cast<size_t>(stage * in_.microbatches + microbatch)];
  }
  int64_t rank_of(int64_t stage) const { return in_.stage_rank[static_cast<size_t>(stage)]; }

  // The stage whose work `action` waits for, or -1 when it waits for none.
  int64_t source_stage(const Action& action) const {
    if (action.type == ActionType::F && action.stage > 0) return action.stage - 1;
    const bool backward = action.type == ActionType::B || action.type == ActionType::I;
    if (backward && action.stage + 1 < in_.stages()) return action.stage + 1;
    return -1;
  }

  bool ready(int64_t rank, const Action& action) {
    const int64_t source = source_stage(action);
    if (source < 0) return true;
    const bool forward = action.type == ActionType::F;
    if (placed(action.stage, action.microbatch) &
        (forward ? kPlacedReceivedForward : kPlacedReceivedBackward)) {
      return true;
    }
    return rank_of(source) == rank &&
           (placed(source, action.microbatch) & (forward ? kPlacedForward : kPlacedBackward));
  }

  void append(int64_t rank, const Action& action, int64_t column) {
    out_.ranks[static_cast<size_t>(rank)].push_back(action);
    if (!out_.csv_columns.empty()) out_.csv_columns[static_cast<size_t>(rank)].push_back(column);
  }

  void place(int64_t rank, const Action& action, int64_t column) {
    append(rank, action, column);
    const bool forward = action.type == ActionType::F;
    const bool backward = action.type == ActionType::B || action.type == ActionType::I;
    if (!forward && !backward) return;
    placed(action.stage, action.microbatch) |= forward ? kPlacedForward : kPlacedBackward;
    const int64_t target = forward ? action.stage + 1 : action.stage - 1;
    if (target < 0 || target >= in_.stages() || rank_of(target) == rank) return;
    append(rank,
           {action.stage, forward ? ActionType::SEND_F : ActionType::SEND_B, action.microbatch}, 0);
    append(rank_of(target),
           {static_cast<int32_t>(target), forward ? ActionType::RECV_F : ActionType::RECV_B,
            action.microbatch},
           0);
    placed(target, action.microbatch) |= forward ? kPlacedReceivedForward : kPlacedReceivedBackward;
  }

  // No rank can move: each waits for work of a rank that waits too, so
  // following the waits from any of them closes a cycle.
  [[noreturn]] void report_stuck() {
    int64_t rank = 0;
    while (!skip_idle(rank)) ++rank;
    std::vector<bool> seen(static_cast<size_t>(in_.pp), false);
    std::vector<int64_t> path;
    for (; !seen[static_cast<size_t>(rank)]; rank = rank_of(source_stage(head(rank)))) {
      seen[static_cast<size_t>(rank)] = true;
      path.push_back(rank);
    }
    std::string cycle;
    bool in_cycle = false;
    for (const int64_t waiting : path) {
      in_cycle = in_cycle || waiting == rank;
      if (!in_cycle) continue;
      const Action& action = head(waiting);
      const int64_t source = source_stage(action);
      cycle += fmt::format(
          "{}{}: {} waits for the {} of stage {} microbatch {} on rank {}",
          cycle.empty() ? "" : "; ",
          position(in_, waiting, static_cast<int64_t>(next_[static_cast<size_t>(waiting)])),
          format_action(action), action.type == ActionType::F ? "F" : "backward", source,
          action.microbatch, rank_of(source));
    }
    throw invalid_argument("the compute order cannot run: " + cycle);
  }

  const Schedule& in_;
  std::vector<size_t> next_;     // per rank: the next entry of its input list
  std::vector<uint8_t> placed_;  // per stage * microbatches + microbatch
  Schedule out_;
};

// Where a stage's sharding actions go in one rank's list.
struct StageSpan {
  int64_t first = -1;  // its first compute action
  int64_t last = -1;   // its last compute action (a B or W), or the send right after it
};

std::vector<StageSpan> stage_spans(const Schedule& schedule, int64_t rank) {
  const auto& list = schedule.ranks[static_cast<size_t>(rank)];
  std::vector<StageSpan> spans(static_cast<size_t>(schedule.stages()));
  for (int64_t step = 0; step < static_cast<int64_t>(list.size()); ++step) {
    const auto& action = list[static_cast<size_t>(step)];
    if (!action) continue;
    if (!is_compute(action->type) && !is_communication(action->type)) {
      throw invalid_argument(fmt::format("{}: {}: the schedule already holds sharding actions",
                                         position(schedule, rank, step), format_action(*action)));
    }
    StageSpan& span = spans[static_cast<size_t>(action->stage)];
    const bool send = action->type == ActionType::SEND_F || action->type == ActionType::SEND_B;
    if (is_compute(action->type)) {
      if (span.first < 0) span.first = step;
      span.last = step;
    } else if (send && span.last == step - 1) {
      span.last = step;
    }
  }
  return spans;
}

}  // namespace

Schedule lower(const Schedule& compute_only) {
  validate_compute(compute_only);
  return Lowering(compute_only).run();
}

Schedule add_sharding_actions(const Schedule& schedule) {
  Schedule out = schedule;
  for (size_t rank = 0; rank < schedule.ranks.size(); ++rank) {
    const auto& list = schedule.ranks[rank];
    const std::vector<StageSpan> spans = stage_spans(schedule, static_cast<int64_t>(rank));
    auto& actions = out.ranks[rank];
    actions.clear();
    std::vector<int64_t> columns;
    const auto add = [&](std::optional<Action> action, int64_t column) {
      actions.push_back(action);
      columns.push_back(column);
    };
    for (int64_t step = 0; step < static_cast<int64_t>(list.size()); ++step) {
      const auto& action = list[static_cast<size_t>(step)];
      const int64_t column =
          schedule.csv_columns.empty() ? 0 : schedule.csv_columns[rank][static_cast<size_t>(step)];
      if (action && spans[static_cast<size_t>(action->stage)].first == step) {
        add(Action{action->stage, ActionType::UNSHARD, -1}, 0);
      }
      add(action, column);
      if (action && spans[static_cast<size_t>(action->stage)].last == step) {
        add(Action{action->stage, ActionType::REDUCE_GRAD, -1}, 0);
        add(Action{action->stage, ActionType::RESHARD, -1}, 0);
      }
    }
    if (!schedule.csv_columns.empty()) out.csv_columns[rank] = std::move(columns);
  }
  return out;
}

}  // namespace meshrun::schedule
