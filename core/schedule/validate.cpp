// Checking schedules: one pass over every rank's list in order, tracking
// per stage and microbatch what has run, then what never ran, then a run of
// the communication with blocking sends and receives to prove it finishes.
#include <fmt/format.h>

#include <cstdint>
#include <deque>

#include "errors.hpp"
#include "schedule/schedule.hpp"

namespace meshrun::schedule {
namespace {

// What has happened to one (stage, microbatch), as bits.
enum Done : uint8_t {
  kForward = 1 << 0,
  kFullBackward = 1 << 1,
  kInputBackward = 1 << 2,
  kWeightBackward = 1 << 3,
  kSentForward = 1 << 4,
  kReceivedForward = 1 << 5,
  kSentBackward = 1 << 6,
  kReceivedBackward = 1 << 7,
};

[[noreturn]] void fail_at(const Schedule& schedule, int64_t rank, int64_t step,
                          const std::string& what) {
  throw invalid_argument(fmt::format("{}: {}", position(schedule, rank, step), what));
}

void check_shape(const Schedule& s) {
  if (s.pp < 1 || s.stages_per_rank < 1 || s.microbatches < 1) {
    throw invalid_argument(
        fmt::format("schedule sizes must be at least 1: pp {}, "
                    "stages_per_rank {}, microbatches {}",
                    s.pp, s.stages_per_rank, s.microbatches));
  }
  if (static_cast<int64_t>(s.ranks.size()) != s.pp) {
    throw invalid_argument(
        fmt::format("the schedule has {} ranks' lists, pp is {}", s.ranks.size(), s.pp));
  }
  if (s.stages() != s.pp * s.stages_per_rank) {
    throw invalid_argument(fmt::format("the placement names {} stages, pp * stages_per_rank is {}",
                                       s.stages(), s.pp * s.stages_per_rank));
  }
  for (int64_t stage = 0; stage < s.stages(); ++stage) {
    const int64_t rank = s.stage_rank[static_cast<size_t>(stage)];
    if (rank < 0 || rank >= s.pp) {
      throw invalid_argument(fmt::format("the placement puts stage {} on rank {}, outside 0..{}",
                                         stage, rank, s.pp - 1));
    }
  }
}

// The single pass over every rank's list. `communication` says whether the
// schedule is complete (inputs from other ranks must have been received) or
// compute-only (they will be, once lowered).
class Checker {
 public:
  Checker(const Schedule& schedule, bool communication)
      : s_(schedule),
        communication_(communication),
        done_(static_cast<size_t>(schedule.stages() * schedule.microbatches), 0),
        sharding_(static_cast<size_t>(schedule.stages())) {}

  void run() {
    mark_sharded_stages();
    for (rank_ = 0; rank_ < s_.pp; ++rank_) {
      const auto& list = s_.ranks[static_cast<size_t>(rank_)];
      for (step_ = 0; step_ < static_cast<int64_t>(list.size()); ++step_) {
        if (const auto& action = list[static_cast<size_t>(step_)]) check(*action);
      }
    }
    check_complete();
  }

 private:
  // The sharding state of a stage: whether it uses UNSHARD at all, is
  // unsharded now, has reduced its gradients, and how many of its m
  // backwards (B or W) have run.
  struct Sharding {
    bool used = false;
    bool unsharded = false;
    bool reduced = false;
    int64_t backwards = 0;
  };

  void mark_sharded_stages() {
    for (const auto& list : s_.ranks) {
      for (const auto& action : list) {
        if (action && action->type == ActionType::UNSHARD && action->stage >= 0 &&
            action->stage < s_.stages()) {
          sharding_[static_cast<size_t>(action->stage)].used = true;
        }
      }
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    fail_at(s_, rank_, step_, fmt::format("{}: {}", format_action(*action_), what));
  }

  uint8_t& done(int64_t stage, int64_t microbatch) {
    return done_[static_cast<size_t>(stage * s_.microbatches + microbatch)];
  }
  bool on_this_rank(int64_t stage) const {
    return s_.stage_rank[static_cast<size_t>(stage)] == rank_;
  }

  void check(const Action& action) {
    action_ = &action;
    check_bounds(action);
    switch (action.type) {
      case ActionType::F:
        return forward(action);
      case ActionType::B:
      case ActionType::I:
        return backward(action);
      case ActionType::W:
        return weight(action);
      case ActionType::SEND_F:
      case ActionType::RECV_F:
      case ActionType::SEND_B:
      case ActionType::RECV_B:
        return transfer(action);
      case ActionType::UNSHARD:
      case ActionType::RESHARD:
      case ActionType::REDUCE_GRAD:
        return sharding(action);
    }
  }

  void check_bounds(const Action& action) const {
    if (action.stage < 0 || action.stage >= s_.stages()) {
      fail(fmt::format("stage {} does not exist (the schedule has stages 0..{})", action.stage,
                       s_.stages() - 1));
    }
    const bool whole_stage = !is_compute(action.type) && !is_communication(action.type);
    if (whole_stage && action.microbatch != -1) fail("concerns a whole stage, not a microbatch");
    if (!whole_stage && (action.microbatch < 0 || action.microbatch >= s_.microbatches)) {
      fail(fmt::format("microbatch {} does not exist (the schedule has microbatches 0..{})",
                       action.microbatch, s_.microbatches - 1));
    }
    if (!on_this_rank(action.stage)) {
      fail(fmt::format("stage {} is placed on rank {}, not on rank {}", action.stage,
                       s_.stage_rank[static_cast<size_t>(action.stage)], rank_));
    }
  }

  void require_unsharded(const Action& action) const {
    const Sharding& stage = sharding_[static_cast<size_t>(action.stage)];
    if (stage.used && !stage.unsharded) {
      fail(fmt::format("stage {} is not unsharded here (no UNSHARD since its last RESHARD)",
                       action.stage));
    }
  }

  void forward(const Action& a) {
    uint8_t& state = done(a.stage, a.microbatch);
    if (state & kForward) fail("runs a second time");
    require_unsharded(a);
    if (a.stage > 0) require_input(a, a.stage - 1, kForward, kReceivedForward);
    state |= kForward;
  }

  void backward(const Action& a) {
    uint8_t& state = done(a.stage, a.microbatch);
    if (!(state & kForward)) fail("runs before the F of its microbatch");
    if (state & (kFullBackward | kInputBackward)) fail("the microbatch's backward already ran");
    require_unsharded(a);
    if (a.stage + 1 < s_.stages()) {
      require_input(a, a.stage + 1, kFullBackward | kInputBackward, kReceivedBackward);
    }
    state |= a.type == ActionType::B ? kFullBackward : kInputBackward;
    if (a.type == ActionType::B) ++sharding_[static_cast<size_t>(a.stage)].backwards;
  }

  void weight(const Action& a) {
    uint8_t& state = done(a.stage, a.microbatch);
    if (!(state & kInputBackward)) fail("runs before the I of its microbatch");
    if (state & kWeightBackward) fail("runs a second time");
    require_unsharded(a);
    state |= kWeightBackward;
    ++sharding_[static_cast<size_t>(a.stage)].backwards;
  }

  // The input of `a` comes from stage `from`: from its earlier work on this
  // rank, or else (complete schedules only) from an earlier receive.
  void require_input(const Action& a, int64_t from, uint8_t from_work, uint8_t received) {
    if (on_this_rank(from)) {
      if (!(done(from, a.microbatch) & from_work)) {
        fail(
            fmt::format("its input comes from stage {} on this rank, which has not yet run "
                        "microbatch {} there",
                        from, a.microbatch));
      }
      return;
    }
    if (communication_ && !(done(a.stage, a.microbatch) & received)) {
      fail(fmt::format(
          "its input from stage {} on rank {} is not received: no {} earlier on "
          "this rank",
          from, s_.stage_rank[static_cast<size_t>(from)],
          format_action({a.stage, a.type == ActionType::F ? ActionType::RECV_F : ActionType::RECV_B,
                         a.microbatch})));
    }
  }

  // A transfer's peer stage, and the bits it sets and needs.
  struct TransferRule {
    int64_t peer;   // the stage at the other end
    uint8_t flag;   // set by this action
    uint8_t needs;  // work that must have run before (sends), 0 for receives
  };

  TransferRule transfer_rule(const Action& a) const {
    switch (a.type) {
      case ActionType::SEND_F:
        return {a.stage + 1, kSentForward, kForward};
      case ActionType::RECV_F:
        return {a.stage - 1, kReceivedForward, 0};
      case ActionType::SEND_B:
        return {a.stage - 1, kSentBackward, kFullBackward | kInputBackward};
      default:
        return {a.stage + 1, kReceivedBackward, 0};
    }
  }

  void transfer(const Action& a) {
    if (!communication_) fail("a compute-only schedule holds no communication");
    const TransferRule rule = transfer_rule(a);
    if (rule.peer < 0 || rule.peer >= s_.stages()) {
      fail(fmt::format("stage {} has no neighbour stage {}", a.stage, rule.peer));
    }
    if (on_this_rank(rule.peer)) {
      fail(fmt::format("stage {} is on this rank too: its data passes without communication",
                       rule.peer));
    }
    uint8_t& state = done(a.stage, a.microbatch);
    if (state & rule.flag) fail("runs a second time");
    if (rule.needs != 0 && !(state & rule.needs)) {
      fail(fmt::format("sends before the {} that produces it",
                       a.type == ActionType::SEND_F ? "F" : "B or I"));
    }
    state |= rule.flag;
  }

  void sharding(const Action& a) {
    Sharding& stage = sharding_[static_cast<size_t>(a.stage)];
    switch (a.type) {
      case ActionType::UNSHARD:
        if (stage.unsharded) fail("the stage is already unsharded");
        stage.unsharded = true;
        return;
      case ActionType::RESHARD:
        if (!stage.unsharded) fail("the stage is not unsharded");
        stage.unsharded = false;
        return;
      default:
        if (stage.reduced) fail("runs a second time");
        if (stage.backwards != s_.microbatches) {
          fail(
              fmt::format("runs after {} of the stage's {} backwards (B or W); it must follow "
                          "the last",
                          stage.backwards, s_.microbatches));
        }
        stage.reduced = true;
    }
  }

  // What never ran, reported at the end of the list of the rank that
  // should have run it.
  void check_complete() {
    for (int64_t stage = 0; stage < s_.stages(); ++stage) {
      for (int64_t mb = 0; mb < s_.microbatches; ++mb) {
        if (const std::string missing = missing_work(stage, mb); !missing.empty()) {
          const int64_t rank = s_.stage_rank[static_cast<size_t>(stage)];
          fail_at(s_, rank, static_cast<int64_t>(s_.ranks[static_cast<size_t>(rank)].size()),
                  fmt::format("stage {} never runs {} for microbatch {}", stage, missing, mb));
        }
      }
    }
  }

  std::string missing_work(int64_t stage, int64_t mb) {
    const uint8_t state = done(stage, mb);
    if (!(state & kForward)) return "F";
    if (!(state & (kFullBackward | kInputBackward))) return "a backward (B, or I and W)";
    if ((state & kInputBackward) && !(state & kWeightBackward)) return "the W after its I";
    if (!communication_) return {};
    const int64_t rank = s_.stage_rank[static_cast<size_t>(stage)];
    const auto elsewhere = [&](int64_t peer) {
      return peer >= 0 && peer < s_.stages() && s_.stage_rank[static_cast<size_t>(peer)] != rank;
    };
    if (elsewhere(stage + 1) && !(state & kSentForward)) return "SEND_F";
    if (elsewhere(stage - 1) && !(state & kReceivedForward)) return "RECV_F";
    if (elsewhere(stage - 1) && !(state & kSentBackward)) return "SEND_B";
    if (elsewhere(stage + 1) && !(state & kReceivedBackward)) return "RECV_B";
    return {};
  }

  const Schedule& s_;
  bool communication_;
  std::vector<uint8_t> done_;  // per stage * microbatches + microbatch
  std::vector<Sharding> sharding_;
  int64_t rank_ = 0;
  int64_t step_ = 0;
  const Action* action_ = nullptr;
};

// The other end of a transfer: its rank and the action it must be at.
struct Counterpart {
  int64_t rank;
  Action action;
};

Counterpart counterpart(const Schedule& s, const Action& a) {
  switch (a.type) {
    case ActionType::SEND_F:
      return {s.stage_rank[static_cast<size_t>(a.stage + 1)],
              {a.stage + 1, ActionType::RECV_F, a.microbatch}};
    case ActionType::RECV_F:
      return {s.stage_rank[static_cast<size_t>(a.stage - 1)],
              {a.stage - 1, ActionType::SEND_F, a.microbatch}};
    case ActionType::SEND_B:
      return {s.stage_rank[static_cast<size_t>(a.stage - 1)],
              {a.stage - 1, ActionType::RECV_B, a.microbatch}};
    default:
      return {s.stage_rank[static_cast<size_t>(a.stage + 1)],
              {a.stage + 1, ActionType::SEND_B, a.microbatch}};
  }
}

bool is_send(ActionType type) { return type == ActionType::SEND_F || type == ActionType::SEND_B; }

// Runs every rank with blocking sends and receives: a transfer completes
// when both ranks stand at its two ends; everything else never blocks (the
// checker has proven its inputs arrive earlier). Event driven: a rank is
// looked at again only when it or its peer moved.
class BlockingRun {
 public:
  explicit BlockingRun(const Schedule& schedule)
      : s_(schedule), next_(static_cast<size_t>(schedule.pp), 0) {}

  void run() {
    std::deque<int64_t> ready;
    for (int64_t rank = 0; rank < s_.pp; ++rank) ready.push_back(rank);
    while (!ready.empty()) {
      const int64_t rank = ready.front();
      ready.pop_front();
      skip_local(rank);
      if (finished(rank)) continue;
      const Counterpart peer = counterpart(s_, head(rank));
      skip_local(peer.rank);
      if (finished(peer.rank)) continue;
      if (head(peer.rank) == peer.action) {
        ++next_[static_cast<size_t>(rank)];
        ++next_[static_cast<size_t>(peer.rank)];
        ready.push_back(rank);
        ready.push_back(peer.rank);
      } else {
        check_order(rank, peer.rank);
      }
    }
    report_deadlock();
  }

 private:
  const std::vector<std::optional<Action>>& list(int64_t rank) const {
    return s_.ranks[static_cast<size_t>(rank)];
  }
  size_t& next(int64_t rank) { return next_[static_cast<size_t>(rank)]; }
  bool finished(int64_t rank) const {
    return next_[static_cast<size_t>(rank)] >= list(rank).size();
  }
  const Action& head(int64_t rank) const { return *list(rank)[next_[static_cast<size_t>(rank)]]; }

  void skip_local(int64_t rank) {
    const auto& actions = list(rank);
    while (next(rank) < actions.size() &&
           (!actions[next(rank)] || !is_communication(actions[next(rank)]->type))) {
      ++next(rank);
    }
  }

  std::string at(int64_t rank) const {
    return fmt::format("{}: {}",
                       position(s_, rank, static_cast<int64_t>(next_[static_cast<size_t>(rank)])),
                       format_action(head(rank)));
  }

  // Two ranks each at a transfer with the other, in the same direction but
  // of different data: they would pair the wrong send and receive.
  void check_order(int64_t rank, int64_t peer) const {
    const Action& mine = head(rank);
    const Action& theirs = head(peer);
    if (!is_communication(theirs.type) || counterpart(s_, theirs).rank != rank) return;
    if (is_send(mine.type) == is_send(theirs.type)) return;
    const int64_t sender = is_send(mine.type) ? rank : peer;
    const int64_t receiver = sender == rank ? peer : rank;
    throw invalid_argument(fmt::format(
        "a send meets the wrong receive: {} meets {}; what rank {} sends to rank {} must be "
        "received in the order it is sent",
        at(sender), at(receiver), sender, receiver));
  }

  // Every unfinished rank waits for the peer of its head; following those
  // waits from any of them must close a cycle.
  void report_deadlock() const {
    int64_t start = 0;
    while (start < s_.pp && finished(start)) ++start;
    if (start == s_.pp) return;
    std::vector<int64_t> seen_at(static_cast<size_t>(s_.pp), -1);
    std::vector<int64_t> path;
    for (int64_t rank = start; seen_at[static_cast<size_t>(rank)] < 0;
         rank = counterpart(s_, head(rank)).rank) {
      seen_at[static_cast<size_t>(rank)] = static_cast<int64_t>(path.size());
      path.push_back(rank);
    }
    const int64_t cycle_start = counterpart(s_, head(path.back())).rank;
    std::string cycle;
    for (size_t i = static_cast<size_t>(seen_at[static_cast<size_t>(cycle_start)]); i < path.size();
         ++i) {
      cycle += fmt::format("{}{} waits for rank {}", cycle.empty() ? "" : "; ", at(path[i]),
                           counterpart(s_, head(path[i])).rank);
    }
    throw invalid_argument("the schedule deadlocks with blocking sends and receives: " + cycle);
  }

  const Schedule& s_;
  std::vector<size_t> next_;
};

}  // namespace

void validate_compute(const Schedule& schedule) {
  check_shape(schedule);
  Checker(schedule, false).run();
}

void validate(const Schedule& schedule) {
  check_shape(schedule);
  Checker(schedule, true).run();
  BlockingRun(schedule).run();
}

}  // namespace meshrun::schedule
