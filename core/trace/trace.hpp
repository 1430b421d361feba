// A rank's timeline, for train.profile: spans of compute (each unit's
// forward and backward, the optimizer, validation), of exposed
// communication (the time the rank blocks inside the strategy's hooks, in
// finish_gradients, on the model's tp/cp/ep transfers and a pipeline's
// sends and receives) and each step. At the end the ranks' spans go to rank
// 0, which the trainer writes as OUTPUT/trace.json in Chrome's trace event
// format (one process per rank), which Perfetto (ui.perfetto.dev) and
// chrome://tracing open; `meshrun trace summary OUTPUT` reads it back.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.hpp"

namespace meshrun::trace {

// The categories of spans. "comm": blocked on communication compute could
// have hidden; "idle": blocked with nothing to compute (a pipeline stage
// waiting for its neighbour's activations or gradients). Neither nests in
// the other or in itself.
inline constexpr const char* kComputeSpan = "compute";
inline constexpr const char* kCommSpan = "comm";
inline constexpr const char* kIdleSpan = "idle";
inline constexpr const char* kStepSpan = "step";

class Trace {
 public:
  using Clock = std::chrono::steady_clock;

  // The process's trace: off until `start`, so that recording costs a
  // branch when train.profile is off.
  static Trace& process();

  // Collective over `world`: starts recording, times counted from a barrier
  // so that ranks' timelines line up.
  void start(Communicator& world);
  bool on() const { return on_; }

  // Records a span [begin, end) (nothing while off).
  void span(std::string name, const char* category, Clock::time_point begin, Clock::time_point end);

  // Collective over the ranks that started: every rank's spans as one Chrome
  // trace on rank 0 (null elsewhere); then every rank stops recording and
  // forgets its spans.
  nlohmann::json gather(Communicator& world);

  // This rank's spans as Chrome trace events of process `rank`.
  nlohmann::json events(int64_t rank) const;

 private:
  struct Span {
    std::string name;
    const char* category;
    int64_t begin_us, duration_us;
  };
  bool on_ = false;
  Clock::time_point origin_;
  std::vector<Span> spans_;
};

// Records the span of its lifetime (while the process trace is on).
class TraceSpan {
 public:
  TraceSpan(std::string name, const char* category);
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  std::string name_;
  const char* category_;
  Trace::Clock::time_point begin_;
};

}  // namespace meshrun::trace
