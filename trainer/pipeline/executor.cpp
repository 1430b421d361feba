#include "pipeline/executor.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <utility>

#include "errors.hpp"
#include "trace/trace.hpp"

namespace meshrun::pipeline {
namespace {

using schedule::Action;
using schedule::ActionType;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Runs `body`, adding its seconds to `total` and tracing it as `name()` of
// `category` (trace/trace.hpp); the name is made only while tracing.
template <class Name, class Body>
void timed(double& total, const char* category, Name&& name, Body&& body) {
  const auto start = Clock::now();
  body();
  total += seconds_since(start);
  trace::Trace& trace = trace::Trace::process();
  if (trace.on()) trace.span(name(), category, start, Clock::now());
}

// The same error with `context` in front, so that a failure deep in a
// stage or the comm backend names the action it broke.
Error with_context(const Error& error, const std::string& context) {
  return Error(error.code(), context + ": " + error.what(), error.key());
}

bool is_backward_transfer(ActionType type) {
  return type == ActionType::SEND_B || type == ActionType::RECV_B;
}

}  // namespace

Executor::Executor(schedule::Schedule lowered, int64_t rank, Communicator& pp,
                   std::map<int64_t, HeldStage> stages, bool pool_received, StateDevice& device)
    : schedule_(std::move(lowered)),
      rank_(rank),
      pp_(pp),
      stages_(std::move(stages)),
      buffers_(pool_received, device) {
  check_schedule();
}

void Executor::check_schedule() const {
  if (schedule_.pp != pp_.size() || static_cast<int64_t>(schedule_.ranks.size()) != schedule_.pp) {
    throw invalid_argument(fmt::format(
        "pipeline schedule '{}' is for pp = {} ({} rows of actions), but communicator '{}' has {} "
        "ranks",
        schedule_.name, schedule_.pp, schedule_.ranks.size(), pp_.name(), pp_.size()));
  }
  if (rank_ != pp_.rank()) {
    throw invalid_argument(fmt::format("pipeline rank {} is rank {} of communicator '{}'", rank_,
                                       pp_.rank(), pp_.name()));
  }
  for (const auto& [stage, held] : stages_) {
    if (stage < 0 || stage >= schedule_.stages() ||
        schedule_.stage_rank[static_cast<size_t>(stage)] != rank_) {
      throw invalid_argument(fmt::format(
          "pipeline rank {} was given stage {}, which schedule '{}' does not place on it", rank_,
          stage, schedule_.name));
    }
  }
  const auto& actions = schedule_.ranks[static_cast<size_t>(rank_)];
  for (size_t step = 0; step < actions.size(); ++step) {
    if (actions[step]) check_action(step, *actions[step]);
  }
  check_neighbours();
}

void Executor::check_action(size_t step, const Action& action) const {
  if (!holds(action.stage)) {
    std::vector<int64_t> held;
    for (const auto& [stage, work] : stages_) held.push_back(stage);
    throw invalid_argument(fmt::format("{}: stage {} is not held by this rank (it holds stages {})",
                                       where(step), action.stage, fmt::join(held, ", ")));
  }
  const bool per_microbatch =
      schedule::is_compute(action.type) || schedule::is_communication(action.type);
  if (per_microbatch && (action.microbatch < 0 || action.microbatch >= schedule_.microbatches)) {
    throw invalid_argument(fmt::format("{}: microbatch {} is not one of the {} of the step",
                                       where(step), action.microbatch, schedule_.microbatches));
  }
  if (!schedule::is_communication(action.type)) return;
  const bool downstream = action.type == ActionType::SEND_F || action.type == ActionType::RECV_B;
  const int64_t peer = action.stage + (downstream ? 1 : -1);
  if (peer < 0 || peer >= schedule_.stages()) {
    throw invalid_argument(fmt::format("{}: stage {} has no neighbour {} to exchange with",
                                       where(step), action.stage, peer));
  }
  if (holds(peer)) {
    throw invalid_argument(fmt::format(
        "{}: stages {} and {} are both on this rank, which hands their activations over without "
        "communication",
        where(step), action.stage, peer));
  }
}

void Executor::check_neighbours() const {
  for (const auto& [stage, held] : stages_) {
    if (!holds(stage + 1)) continue;
    const int64_t produced = held.work.output_numel();
    const int64_t consumed = stages_.at(stage + 1).work.input_numel();
    if (produced != consumed) {
      throw invalid_argument(fmt::format(
          "pipeline rank {}: stage {} outputs {} elements per microbatch, but stage {} takes {}",
          rank_, stage, produced, stage + 1, consumed));
    }
  }
}

std::string Executor::where(size_t step) const {
  const auto& action = schedule_.ranks[static_cast<size_t>(rank_)][step];
  return fmt::format("pipeline {} ({})",
                     schedule::position(schedule_, rank_, static_cast<int64_t>(step)),
                     action ? schedule::format_action(*action) : "idle");
}

int64_t Executor::tag(int32_t edge, int32_t microbatch, bool backward) const {
  const int64_t edges = schedule_.stages() - 1;
  return (microbatch * edges + edge) * 2 + (backward ? 1 : 0);
}

StepTimes Executor::run_step() {
  const auto start = Clock::now();
  // What a failed step left in flight is waited for and dropped here, so
  // that one step's error does not leak into the next.
  sends_.clear();
  sent_.clear();
  receives_.clear();
  buffers_.clear();
  buffers_.reset_peak();
  StepTimes times;
  const auto& actions = schedule_.ranks[static_cast<size_t>(rank_)];
  for (size_t step = 0; step < actions.size(); ++step) {
    if (!actions[step]) continue;
    try {
      run_action(step, *actions[step], times);
    } catch (const Error& error) {
      throw with_context(error, where(step));
    }
    release_sent();
  }
  finish(times);
  times.wall_s = seconds_since(start);
  return times;
}

void Executor::run_action(size_t step, const Action& action, StepTimes& times) {
  switch (action.type) {
    case ActionType::F:
      forward(action, times);
      return;
    case ActionType::B:
    case ActionType::I:
      backward(action, times);
      return;
    case ActionType::W:
      timed(
          times.compute_s, trace::kComputeSpan, [&] { return format_action(action); },
          [&] { work(action.stage).backward_weight(action.microbatch); });
      return;
    case ActionType::SEND_F:
    case ActionType::SEND_B:
      send(step, action);
      return;
    case ActionType::RECV_F:
    case ActionType::RECV_B:
      receive(step, action);
      return;
    case ActionType::UNSHARD:
    case ActionType::RESHARD:
    case ActionType::REDUCE_GRAD:
      shard(action, times);
      return;
  }
}

void Executor::forward(const Action& action, StepTimes& times) {
  StageWork& stage = work(action.stage);
  const BufferKey input{BufferKind::input, action.stage, action.microbatch};
  const BufferKey output{BufferKind::output, action.stage, action.microbatch};
  const float* in = action.stage > 0 ? take_input(input, times) : nullptr;
  const bool last = action.stage == schedule_.stages() - 1;
  float* out = last ? nullptr : buffers_.allocate(output, stage.output_numel());
  timed(
      times.compute_s, trace::kComputeSpan, [&] { return format_action(action); },
      [&] { stage.forward(action.microbatch, in, out); });
  buffers_.release(input);
  if (out != nullptr) hand_over(output, action.stage + 1, BufferKind::input);
}

// B and I consume the same buffers; I leaves what W needs with the stage.
void Executor::backward(const Action& action, StepTimes& times) {
  StageWork& stage = work(action.stage);
  const BufferKey grad_output{BufferKind::grad_output, action.stage, action.microbatch};
  const BufferKey grad_input{BufferKind::grad_input, action.stage, action.microbatch};
  const bool last = action.stage == schedule_.stages() - 1;
  const float* in = last ? nullptr : take_input(grad_output, times);
  float* out = action.stage > 0 ? buffers_.allocate(grad_input, stage.input_numel()) : nullptr;
  timed(
      times.compute_s, trace::kComputeSpan, [&] { return format_action(action); },
      [&] {
        if (action.type == ActionType::B) {
          stage.backward(action.microbatch, in, out);
        } else {
          stage.backward_input(action.microbatch, in, out);
        }
      });
  buffers_.release(grad_output);
  if (out != nullptr) hand_over(grad_input, action.stage - 1, BufferKind::grad_output);
}

// The activation a compute consumes: its receive, if one is in flight, is
// waited for now and not before.
float* Executor::take_input(const BufferKey& key, StepTimes& times) {
  const auto pending = receives_.find(key);
  if (pending != receives_.end()) {
    try {
      timed(
          times.wait_s, trace::kIdleSpan, [&] { return "wait for " + where(pending->second.step); },
          [&] { pending->second.request.wait(); });
    } catch (const Error& error) {
      throw with_context(error, "waiting for the receive of " + where(pending->second.step));
    }
    receives_.erase(pending);
  }
  float* data = buffers_.find(key);
  if (data == nullptr) {
    throw invalid_argument(fmt::format(
        "the {} is consumed before anything produced it (no receive or local stage before it)",
        describe(key)));
  }
  return data;
}

// An activation (or gradient) whose consumer is on this rank becomes the
// consumer's input in place; otherwise it waits for its SEND.
void Executor::hand_over(const BufferKey& produced, int32_t consumer, BufferKind kind) {
  if (!holds(consumer)) return;
  buffers_.rename(produced, {kind, consumer, produced.microbatch});
}

// A SEND_F carries stage s's output to stage s + 1 over edge s; a SEND_B
// carries its input gradient to stage s - 1 over edge s - 1.
void Executor::send(size_t step, const Action& action) {
  const bool backward = is_backward_transfer(action.type);
  const BufferKey key{backward ? BufferKind::grad_input : BufferKind::output, action.stage,
                      action.microbatch};
  // Checked before the buffer is looked up: the first send may have
  // completed and freed it, or still be in flight with it.
  if (!sent_.insert(key).second) {
    throw invalid_argument(fmt::format("the {} is sent twice", describe(key)));
  }
  float* data = buffers_.find(key);
  if (data == nullptr) {
    throw invalid_argument(
        fmt::format("the {} is sent before the compute that produces it", describe(key)));
  }
  const StageWork& stage = work(action.stage);
  const int64_t numel = backward ? stage.input_numel() : stage.output_numel();
  const int32_t peer = action.stage + (backward ? -1 : 1);
  const int32_t edge = backward ? action.stage - 1 : action.stage;
  FlatTensor tensor(data, dtype_float32(), numel, buffers_.device().where());
  Request request = pp_.send(tensor.get(), schedule_.stage_rank[static_cast<size_t>(peer)],
                             tag(edge, action.microbatch, backward));
  sends_.push_back({std::move(request), key, step});
}

// A RECV_F fills stage s's input from stage s - 1 over edge s - 1; a RECV_B
// fills its output gradient from stage s + 1 over edge s.
void Executor::receive(size_t step, const Action& action) {
  const bool backward = is_backward_transfer(action.type);
  const BufferKey key{backward ? BufferKind::grad_output : BufferKind::input, action.stage,
                      action.microbatch};
  const StageWork& stage = work(action.stage);
  const int64_t numel = backward ? stage.output_numel() : stage.input_numel();
  const int32_t peer = action.stage + (backward ? 1 : -1);
  const int32_t edge = backward ? action.stage : action.stage - 1;
  float* data = buffers_.receive(key, numel);
  FlatTensor tensor(data, dtype_float32(), numel, buffers_.device().where());
  Request request = pp_.recv(tensor.get(), schedule_.stage_rank[static_cast<size_t>(peer)],
                             tag(edge, action.microbatch, backward));
  receives_.emplace(key, InFlight{std::move(request), key, step});
}

void Executor::shard(const Action& action, StepTimes& times) {
  StageSharding* sharding = stages_.at(action.stage).sharding;
  if (sharding == nullptr) return;
  timed(
      times.sharding_s, trace::kCommSpan, [&] { return format_action(action); },
      [&] {
        if (action.type == ActionType::UNSHARD) {
          sharding->unshard();
        } else if (action.type == ActionType::RESHARD) {
          sharding->reshard();
        } else {
          sharding->reduce_grad();
        }
      });
}

// Frees the buffers of sends that have completed, so that memory follows
// the activations in flight rather than the step's end.
void Executor::release_sent() {
  std::erase_if(sends_, [&](InFlight& send) {
    bool done = false;
    try {
      done = send.request.test();
    } catch (const Error& error) {
      throw with_context(error, where(send.step));
    }
    if (done) buffers_.release(send.buffer);
    return done;
  });
}

void Executor::finish(StepTimes& times) {
  const auto wait_all = [&](InFlight& transfer) {
    try {
      timed(
          times.wait_s, trace::kIdleSpan, [&] { return "wait for " + where(transfer.step); },
          [&] { transfer.request.wait(); });
    } catch (const Error& error) {
      throw with_context(error, where(transfer.step));
    }
  };
  for (auto& [key, receive] : receives_) wait_all(receive);
  receives_.clear();
  for (auto& send : sends_) {
    wait_all(send);
    buffers_.release(send.buffer);
  }
  sends_.clear();
  check_released();
}

// A buffer left at the end is an activation the schedule produced (or
// received) and never consumed or sent: a schedule error.
void Executor::check_released() {
  if (buffers_.live() == 0) return;
  std::vector<std::string> left;
  for (const BufferKey& key : buffers_.keys()) left.push_back(describe(key));
  buffers_.clear();
  throw invalid_argument(
      fmt::format("pipeline rank {}: schedule '{}' leaves buffers that no action consumed ({}): {}",
                  rank_, schedule_.name, left.size(), fmt::join(left, "; ")));
}

}  // namespace meshrun::pipeline
