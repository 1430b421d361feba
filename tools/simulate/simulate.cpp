#include "simulate/simulate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <numeric>
#include <string>

#include "errors.hpp"

namespace meshrun::schedule {
namespace {

// What finishing an action makes available to other actions. Nothing waits
// for a W, so it has no event.
enum Event : int {
  kForwardDone,
  kBackwardDone,
  kSendF,
  kSendB,
  kRecvF,
  kRecvB,
  kEventKinds,
  kNoEvent
};

Event event_of(ActionType type) {
  switch (type) {
    case ActionType::F:
      return kForwardDone;
    case ActionType::B:
    case ActionType::I:
      return kBackwardDone;
    case ActionType::SEND_F:
      return kSendF;
    case ActionType::SEND_B:
      return kSendB;
    case ActionType::RECV_F:
      return kRecvF;
    case ActionType::RECV_B:
      return kRecvB;
    default:
      return kNoEvent;
  }
}

// An input of an action: the event, and how long after it the input is there.
struct Dependency {
  size_t event = 0;
  double delay = 0;
};

void check_costs(const Costs& costs) {
  for (const double cost : {costs.F, costs.B, costs.I, costs.W, costs.send, costs.recv}) {
    if (!std::isfinite(cost) || cost < 0) {
      throw invalid_argument(fmt::format("action cost {} is not a finite number >= 0", cost));
    }
  }
}

// Why `action` names no stage or microbatch of the schedule, or "".
std::string out_of_range(const Action& action, int64_t stages, int64_t microbatches) {
  if (action.stage < 0 || action.stage >= stages) {
    return fmt::format("stage {} is not in [0, {})", action.stage, stages);
  }
  const bool whole_stage = !is_compute(action.type) && !is_communication(action.type);
  if (whole_stage) return "";
  if (action.microbatch < 0 || action.microbatch >= microbatches) {
    return fmt::format("microbatch {} is not in [0, {})", action.microbatch, microbatches);
  }
  const bool from_previous = action.type == ActionType::RECV_F || action.type == ActionType::SEND_B;
  const bool to_next = action.type == ActionType::SEND_F || action.type == ActionType::RECV_B;
  if ((from_previous && action.stage == 0) || (to_next && action.stage == stages - 1)) {
    return fmt::format("stage {} has no neighbour to communicate with", action.stage);
  }
  return "";
}

// One pass over the schedule in dependency order. Every rank advances until
// an input is missing, then waits on that one event in an intrusive list;
// finishing an event wakes its waiters. Each action is looked at a bounded
// number of times, so the cost is linear in the number of actions.
class Simulator {
 public:
  Simulator(const Schedule& schedule, const Costs& costs)
      : schedule_(schedule),
        costs_(costs),
        ranks_(static_cast<int64_t>(schedule.ranks.size())),
        stages_(schedule.stages()),
        microbatches_(schedule.microbatches),
        done_(kEventKinds * stages_ * microbatches_, -1.0),
        posted_(done_.size(), -1.0),
        expected_(done_.size(), false),
        waiting_head_(done_.size(), -1),
        next_waiting_(ranks_, -1),
        step_(ranks_, 0),
        free_at_(ranks_, 0.0),
        busy_(ranks_, 0.0) {
    result_.timelines.resize(ranks_);
  }

  Simulation run() {
    check_and_mark_events();
    runnable_.resize(ranks_);
    std::iota(runnable_.begin(), runnable_.end(), 0);
    while (!runnable_.empty()) {
      const int64_t rank = runnable_.back();
      runnable_.pop_back();
      advance(rank);
    }
    check_finished();
    summarize();
    return std::move(result_);
  }

 private:
  size_t index(Event event, int64_t stage, int64_t microbatch) const {
    return static_cast<size_t>((event * stages_ + stage) * microbatches_ + microbatch);
  }

  // Range-checks every action and records which events some action
  // produces: a compute action takes its input from a RECV only where the
  // schedule has one.
  void check_and_mark_events() {
    for (int64_t rank = 0; rank < ranks_; ++rank) {
      const auto& actions = schedule_.ranks[rank];
      for (size_t step = 0; step < actions.size(); ++step) {
        if (!actions[step]) continue;
        const Action& action = *actions[step];
        if (const std::string why = out_of_range(action, stages_, microbatches_); !why.empty()) {
          throw invalid_argument(fmt::format("{}: action '{}': {}", position(schedule_, rank, step),
                                             format_action(action), why));
        }
        const Event event = event_of(action.type);
        if (event != kNoEvent) expected_[index(event, action.stage, action.microbatch)] = true;
      }
    }
  }

  // The input that comes from stage `from` to stage `to`: through the RECV
  // of `to` where there is one, else straight from the producer.
  Dependency input(Event receive, Event produce, int64_t from, int64_t to,
                   int64_t microbatch) const {
    const size_t received = index(receive, to, microbatch);
    if (expected_[received]) return {received, 0};
    const bool crosses_ranks = schedule_.stage_rank[from] != schedule_.stage_rank[to];
    return {index(produce, from, microbatch), crosses_ranks ? costs_.send + costs_.recv : 0};
  }

  // Fills `deps` with the inputs of `action`; returns how many.
  int dependencies(const Action& action, std::array<Dependency, 2>& deps) const {
    const int64_t stage = action.stage;
    const int64_t mb = action.microbatch;
    switch (action.type) {
      case ActionType::F:
        if (stage == 0) return 0;
        deps[0] = input(kRecvF, kForwardDone, stage - 1, stage, mb);
        return 1;
      case ActionType::B:
      case ActionType::I:
        deps[0] = {index(kForwardDone, stage, mb), 0};
        if (stage == stages_ - 1) return 1;
        deps[1] = input(kRecvB, kBackwardDone, stage + 1, stage, mb);
        return 2;
      case ActionType::W:
        deps[0] = {index(kBackwardDone, stage, mb), 0};
        return 1;
      case ActionType::SEND_F:
        deps[0] = {index(kForwardDone, stage, mb), 0};
        return 1;
      case ActionType::SEND_B:
        deps[0] = {index(kBackwardDone, stage, mb), 0};
        return 1;
      default:
        return 0;
    }
  }

  // Runs `rank`'s actions until one lacks an input (then it waits for that
  // event) or none are left.
  void advance(int64_t rank) {
    const auto& actions = schedule_.ranks[rank];
    for (size_t& step = step_[rank]; step < actions.size(); ++step) {
      if (!actions[step]) continue;
      std::array<Dependency, 2> deps;
      const int count = dependencies(*actions[step], deps);
      double start = free_at_[rank];
      for (int i = 0; i < count; ++i) {
        const double ready = done_[deps[i].event];
        if (ready < 0) return wait(rank, deps[i].event);
        start = std::max(start, ready + deps[i].delay);
      }
      execute(rank, *actions[step], start);
    }
  }

  void wait(int64_t rank, size_t event) {
    next_waiting_[rank] = waiting_head_[event];
    waiting_head_[event] = rank;
  }

  void execute(int64_t rank, const Action& action, double start) {
    switch (action.type) {
      case ActionType::SEND_F:
        return send(action, index(kRecvF, action.stage + 1, action.microbatch), start);
      case ActionType::SEND_B:
        return send(action, index(kRecvB, action.stage - 1, action.microbatch), start);
      case ActionType::RECV_F:
        return post_receive(action, index(kSendF, action.stage - 1, action.microbatch), start);
      case ActionType::RECV_B:
        return post_receive(action, index(kSendB, action.stage + 1, action.microbatch), start);
      default:
        break;
    }
    const double end = start + costs_.of(action.type);
    free_at_[rank] = end;
    if (!is_compute(action.type)) return;
    result_.timelines[rank].push_back({start, end, action});
    busy_[rank] += end - start;
    if (event_of(action.type) != kNoEvent) finish(own_event(action), end);
  }

  size_t own_event(const Action& action) const {
    return index(event_of(action.type), action.stage, action.microbatch);
  }

  // Sends and receives are asynchronous, as in PyTorch's pipeline runtime:
  // they take no rank time; a receive completes once it is posted and the
  // data has had `send` + `recv` to travel.
  void send(const Action& action, size_t receive, double issued) {
    const double sent = issued + costs_.send;
    finish(own_event(action), sent);
    if (posted_[receive] >= 0) finish(receive, std::max(posted_[receive], sent + costs_.recv));
  }

  void post_receive(const Action& action, size_t send, double posted) {
    const size_t receive = own_event(action);
    posted_[receive] = posted;
    if (done_[send] >= 0) finish(receive, std::max(posted, done_[send] + costs_.recv));
  }

  void finish(size_t event, double time) {
    done_[event] = time;
    for (int64_t waiter = waiting_head_[event]; waiter >= 0; waiter = next_waiting_[waiter]) {
      runnable_.push_back(waiter);
    }
    waiting_head_[event] = -1;
  }

  void check_finished() const {
    constexpr size_t kNamed = 8;
    std::vector<std::string> blocked;
    for (int64_t rank = 0; rank < ranks_; ++rank) {
      const size_t step = step_[rank];
      if (step == schedule_.ranks[rank].size()) continue;
      if (blocked.size() < kNamed) {
        blocked.push_back(fmt::format("{} ('{}')", position(schedule_, rank, step),
                                      format_action(*schedule_.ranks[rank][step])));
      } else if (blocked.size() == kNamed) {
        blocked.push_back("...");
      }
    }
    if (blocked.empty()) return;
    throw invalid_argument(
        fmt::format("the schedule cannot finish: waiting for an input that never comes: {}",
                    fmt::join(blocked, ", ")));
  }

  void summarize() {
    result_.makespan = std::accumulate(free_at_.begin(), free_at_.end(), 0.0,
                                       [](double a, double b) { return std::max(a, b); });
    double total_idle = 0;
    for (const double busy : busy_) {
      result_.idle.push_back(result_.makespan - busy);
      total_idle += result_.idle.back();
    }
    if (result_.makespan > 0) {
      result_.bubble_fraction = total_idle / (static_cast<double>(ranks_) * result_.makespan);
    }
  }

  const Schedule& schedule_;
  const Costs& costs_;
  const int64_t ranks_;
  const int64_t stages_;
  const int64_t microbatches_;
  std::vector<double> done_;           // per event: when it happened; -1 until then
  std::vector<double> posted_;         // per RECV event: when its rank posted it; -1 until then
  std::vector<bool> expected_;         // per event: whether some action produces it
  std::vector<int64_t> waiting_head_;  // per event: a rank waiting for it, or -1
  std::vector<int64_t> next_waiting_;  // per rank: the next rank waiting for the same event
  std::vector<size_t> step_;           // per rank: its next action
  std::vector<double> free_at_;
  std::vector<double> busy_;  // per rank: compute time
  std::vector<int64_t> runnable_;
  Simulation result_;
};

int64_t peak_activations(const std::vector<std::optional<Action>>& actions) {
  int64_t held = 0;
  int64_t peak = 0;
  for (const auto& action : actions) {
    if (!action) continue;
    if (action->type == ActionType::F) peak = std::max(peak, ++held);
    if (action->type == ActionType::B || action->type == ActionType::I) --held;
  }
  return peak;
}

double parse_cost(std::string_view key, std::string_view value) {
  double cost = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), cost);
  if (error != std::errc() || end != value.data() + value.size() || !std::isfinite(cost) ||
      cost < 0) {
    throw invalid_argument(
        fmt::format("cost of {} must be a finite number >= 0, got '{}'", key, value));
  }
  return cost;
}

}  // namespace

double Costs::of(ActionType type) const {
  switch (type) {
    case ActionType::F:
      return F;
    case ActionType::B:
      return B;
    case ActionType::I:
      return I;
    case ActionType::W:
      return W;
    default:
      return 0;
  }
}

Costs parse_costs(std::string_view text) {
  Costs costs;
  const std::array<std::pair<std::string_view, double*>, 6> keys = {{{"F", &costs.F},
                                                                     {"B", &costs.B},
                                                                     {"I", &costs.I},
                                                                     {"W", &costs.W},
                                                                     {"send", &costs.send},
                                                                     {"recv", &costs.recv}}};
  for (size_t begin = 0; begin <= text.size();) {
    const size_t comma = std::min(text.find(',', begin), text.size());
    const std::string_view entry = text.substr(begin, comma - begin);
    begin = comma + 1;
    const size_t equals = entry.find('=');
    const std::string_view key = entry.substr(0, equals);
    const auto known = std::find_if(keys.begin(), keys.end(),
                                    [&](const auto& candidate) { return candidate.first == key; });
    if (equals == std::string_view::npos || known == keys.end()) {
      throw invalid_argument(fmt::format(
          "expected KEY=VALUE entries separated by commas with KEY one of F, B, I, W, send, "
          "recv, got '{}'",
          entry));
    }
    *known->second = parse_cost(key, entry.substr(equals + 1));
  }
  return costs;
}

Simulation simulate(const Schedule& schedule, const Costs& costs) {
  check_costs(costs);
  if (schedule.microbatches < 0) {
    throw invalid_argument(fmt::format("schedule '{}': microbatches must be >= 0, got {}",
                                       schedule.name, schedule.microbatches));
  }
  Simulation simulation = Simulator(schedule, costs).run();
  for (const auto& actions : schedule.ranks) {
    simulation.peak_activations.push_back(peak_activations(actions));
  }
  return simulation;
}

}  // namespace meshrun::schedule
