// The 1F1B family: after a warm-up of forwards, every step runs one forward
// and one backward, then a cool-down drains the backwards. 1F1B (Narayanan
// et al. 2019) holds one stage per rank; Interleaved 1F1B (Narayanan et al.
// 2021) loops v stages over the ranks and switches local stage every round
// of microbatches, depth first; Interleaved Zero Bubble (Qi et al. 2023,
// ZB1P) splits each backward into I, on the critical path, and W, deferred
// to fill the bubbles. All three are PyTorch's _get_1f1b_rank_ops with
// their warm-up lengths.
#include <algorithm>
#include <deque>

#include "schedules/generators.hpp"

namespace meshrun::schedules {
namespace {

// One rank's shape of a 1F1B-family schedule.
struct Plan {
  int64_t pp = 1;
  int64_t stages_per_rank = 1;
  int64_t microbatches = 1;
  int64_t rank = 0;
  int64_t warmup = 0;     // forwards before the first backward
  int64_t per_round = 1;  // microbatches a local stage runs before the next takes over
  bool split_backward = false;
  // Split backward only: I actions whose W waits past the steady state's
  // first pairs (PyTorch defers rank r's first r weights).
  int64_t deferred_weights = 0;
};

class RankBuilder {
 public:
  explicit RankBuilder(const Plan& plan)
      : plan_(plan),
        next_forward_(static_cast<size_t>(plan.stages_per_rank), 0),
        next_backward_(static_cast<size_t>(plan.stages_per_rank), 0) {}

  // Op k runs the k-th forward (while there are any) and, from the end of
  // the warm-up, the (k - warmup)-th backward.
  std::vector<Action> build() {
    const int64_t total = plan_.stages_per_rank * plan_.microbatches;
    for (int64_t op = 0; op < total + plan_.warmup; ++op) {
      if (op < total) add(stage_at(op / plan_.per_round), ActionType::F, next_forward_);
      if (op >= plan_.warmup) backward(op - plan_.warmup);
    }
    while (!pending_weights_.empty()) weight();
    return std::move(actions_);
  }

 private:
  // The global stage of local stage (index mod v) of this rank.
  int32_t stage_at(int64_t index) const {
    return static_cast<int32_t>((index % plan_.stages_per_rank) * plan_.pp + plan_.rank);
  }

  // Backwards walk the local stages from the last, a round at a time.
  void backward(int64_t k) {
    const int64_t local = plan_.stages_per_rank - 1 - (k / plan_.per_round) % plan_.stages_per_rank;
    const int32_t stage = stage_at(local);
    if (!plan_.split_backward) {
      add(stage, ActionType::B, next_backward_);
      return;
    }
    pending_weights_.push_back(add(stage, ActionType::I, next_backward_));
    if (k >= plan_.deferred_weights) weight();
  }

  void weight() {
    actions_.push_back(
        {pending_weights_.front().stage, ActionType::W, pending_weights_.front().microbatch});
    pending_weights_.pop_front();
  }

  // Appends `type` for the stage's next microbatch as counted by `next`.
  Action add(int32_t stage, ActionType type, std::vector<int32_t>& next) {
    int32_t& microbatch = next[static_cast<size_t>(stage / plan_.pp)];
    actions_.push_back({stage, type, microbatch++});
    return actions_.back();
  }

  Plan plan_;
  std::vector<int32_t> next_forward_;   // per local stage
  std::vector<int32_t> next_backward_;  // per local stage
  std::deque<Action> pending_weights_;  // I actions whose W has not run, oldest first
  std::vector<Action> actions_;
};

template <class PlanOfRank>
RankActions build_ranks(const Sizes& sizes, PlanOfRank plan_of_rank) {
  RankActions ranks;
  ranks.reserve(static_cast<size_t>(sizes.pp));
  for (int64_t rank = 0; rank < sizes.pp; ++rank) {
    ranks.push_back(RankBuilder(plan_of_rank(rank)).build());
  }
  return ranks;
}

Plan base_plan(const Sizes& sizes, int64_t rank) {
  Plan plan;
  plan.pp = sizes.pp;
  plan.stages_per_rank = sizes.stages_per_rank;
  plan.microbatches = sizes.microbatches;
  plan.rank = rank;
  plan.per_round = sizes.microbatches;
  return plan;
}

// Interleaved schedules run the microbatches in rounds of at most pp
// (PyTorch relaxes Megatron's m % pp == 0 to this); every round must be
// equally long.
int64_t microbatches_per_round(const std::string& schedule, const Sizes& sizes) {
  const int64_t rounds = std::max<int64_t>(1, sizes.microbatches / sizes.pp);
  if (sizes.microbatches % rounds != 0) {
    refuse(schedule,
           "microbatches to be a multiple of the number of rounds max(1, microbatches / pp) = " +
               std::to_string(rounds),
           "microbatches " + std::to_string(sizes.microbatches) + " with pp " +
               std::to_string(sizes.pp));
  }
  return sizes.microbatches / rounds;
}

// Forwards before rank `rank`'s first backward: the last rank fills its other
// local stages for a round each, and every hop towards rank 0 adds `per_hop`.
int64_t interleaved_warmup(const Sizes& sizes, int64_t rank, int64_t per_round, int64_t per_hop) {
  const int64_t warmup = (sizes.stages_per_rank - 1) * per_round + per_hop * (sizes.pp - 1 - rank);
  return std::min(warmup, sizes.stages_per_rank * sizes.microbatches);
}

// An interleaved schedule: rounds of microbatches per local stage, and a
// warm-up `per_hop` forwards longer per rank away from the last.
RankActions interleaved(const std::string& schedule, const Sizes& sizes, int64_t per_hop,
                        bool split_backward) {
  const int64_t per_round = microbatches_per_round(schedule, sizes);
  return build_ranks(sizes, [&](int64_t rank) {
    Plan plan = base_plan(sizes, rank);
    plan.per_round = per_round;
    plan.warmup = interleaved_warmup(sizes, rank, per_round, per_hop);
    plan.split_backward = split_backward;
    plan.deferred_weights = split_backward ? rank : 0;
    return plan;
  });
}

}  // namespace

RankActions one_f_one_b(const Sizes& sizes) {
  require_stages_per_rank("1f1b", sizes, 1, "one stage per rank");
  return build_ranks(sizes, [&](int64_t rank) {
    Plan plan = base_plan(sizes, rank);
    plan.warmup = std::min(sizes.microbatches, sizes.pp - 1 - rank);
    return plan;
  });
}

RankActions interleaved_1f1b(const Sizes& sizes) {
  return interleaved("interleaved_1f1b", sizes, 2, false);
}

RankActions interleaved_zero_bubble(const Sizes& sizes) {
  return interleaved("interleaved_zero_bubble", sizes, 1, true);
}

}  // namespace meshrun::schedules
