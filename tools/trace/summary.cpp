#include "trace/summary.hpp"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

#include "trace/trace.hpp"

namespace meshrun::trace {

namespace {

struct Interval {
  int64_t begin = 0, end = 0;
};

struct RankSpans {
  std::vector<Interval> steps, comm, idle;
};

const nlohmann::json& field(const nlohmann::json& object, const char* key, const char* what) {
  if (!object.is_object() || !object.contains(key)) {
    throw std::invalid_argument(std::string(what) + " has no \"" + key + "\"");
  }
  return object.at(key);
}

// The microseconds of `spans` that begin inside one of `steps` (sorted).
int64_t inside_steps(const std::vector<Interval>& spans, const std::vector<Interval>& steps) {
  int64_t total = 0;
  for (const Interval& span : spans) {
    auto after = std::upper_bound(steps.begin(), steps.end(), span.begin,
                                  [](int64_t t, const Interval& step) { return t < step.begin; });
    if (after != steps.begin() && span.begin < std::prev(after)->end)
      total += span.end - span.begin;
  }
  return total;
}

}  // namespace

std::vector<RankShares> summarize_trace(const nlohmann::json& trace) {
  const nlohmann::json& events = field(trace, "traceEvents", "the trace");
  if (!events.is_array()) throw std::invalid_argument("the trace's \"traceEvents\" is no array");
  std::map<int64_t, RankSpans> ranks;
  for (const nlohmann::json& event : events) {
    if (field(event, "ph", "an event") != "X") continue;
    const auto begin = field(event, "ts", "an event").get<int64_t>();
    const Interval span{begin, begin + field(event, "dur", "an event").get<int64_t>()};
    RankSpans& spans = ranks[field(event, "pid", "an event").get<int64_t>()];
    const std::string category = event.value("cat", "");
    if (category == kStepSpan) spans.steps.push_back(span);
    if (category == kCommSpan) spans.comm.push_back(span);
    if (category == kIdleSpan) spans.idle.push_back(span);
  }
  std::vector<RankShares> shares;
  for (auto& [rank, spans] : ranks) {
    std::sort(spans.steps.begin(), spans.steps.end(),
              [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
    int64_t stepping = 0;
    for (const Interval& step : spans.steps) stepping += step.end - step.begin;
    const double total = double(std::max<int64_t>(1, stepping));
    RankShares s;
    s.rank = rank;
    s.steps = int64_t(spans.steps.size());
    s.seconds = double(stepping) / 1e6;
    s.comm = double(inside_steps(spans.comm, spans.steps)) / total;
    s.idle = double(inside_steps(spans.idle, spans.steps)) / total;
    s.compute = std::max(0.0, 1.0 - s.comm - s.idle);
    shares.push_back(s);
  }
  return shares;
}

}  // namespace meshrun::trace
