#include "trace/trace.hpp"

#include <algorithm>
#include <iterator>
#include <map>
#include <stdexcept>

namespace meshrun::trace {

Trace& Trace::process() {
  static Trace trace;
  return trace;
}

void Trace::start(Communicator& world) {
  world.barrier().wait();
  origin_ = Clock::now();
  spans_.clear();
  on_ = true;
}

void Trace::span(std::string name, const char* category, Clock::time_point begin,
                 Clock::time_point end) {
  if (!on_) return;
  using std::chrono::duration_cast;
  using std::chrono::microseconds;
  spans_.push_back({std::move(name), category, duration_cast<microseconds>(begin - origin_).count(),
                    duration_cast<microseconds>(end - begin).count()});
}

nlohmann::json Trace::events(int64_t rank) const {
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", rank},
                    {"args", {{"name", "rank " + std::to_string(rank)}}}});
  for (const Span& s : spans_) {
    events.push_back({{"name", s.name},
                      {"cat", s.category},
                      {"ph", "X"},
                      {"ts", s.begin_us},
                      {"dur", s.duration_us},
                      {"pid", rank},
                      {"tid", 0}});
  }
  return events;
}

namespace {

// Every rank's `text` on rank 0 (an empty list elsewhere), through two
// all_gathers: the lengths, then the texts padded to the longest.
std::vector<std::string> gather_texts(Communicator& world, const std::string& text) {
  const auto ranks = size_t(world.size());
  std::vector<int64_t> lengths(ranks);
  int64_t length = int64_t(text.size());
  FlatTensor send_length(&length, dtype_int64(), 1);
  FlatTensor all_lengths(lengths.data(), dtype_int64(), int64_t(ranks));
  world.all_gather(send_length.get(), all_lengths.get()).wait();
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  const int64_t words = (longest + 7) / 8;  // sent as int64 elements
  std::vector<int64_t> padded(size_t(words), 0), gathered(size_t(words) * ranks);
  std::copy(text.begin(), text.end(), reinterpret_cast<char*>(padded.data()));
  FlatTensor send(padded.data(), dtype_int64(), words);
  FlatTensor recv(gathered.data(), dtype_int64(), words * int64_t(ranks));
  world.all_gather(send.get(), recv.get()).wait();
  std::vector<std::string> texts;
  if (world.rank() != 0) return texts;
  for (size_t r = 0; r < ranks; ++r) {
    const char* begin = reinterpret_cast<const char*>(gathered.data() + r * size_t(words));
    texts.emplace_back(begin, size_t(lengths[r]));
  }
  return texts;
}

}  // namespace

nlohmann::json Trace::gather(Communicator& world) {
  const std::vector<std::string> texts = gather_texts(world, events(world.rank()).dump());
  on_ = false;
  spans_.clear();
  if (world.rank() != 0) return nullptr;
  nlohmann::json all = nlohmann::json::array();
  for (const std::string& text : texts) {
    for (auto& event : nlohmann::json::parse(text)) all.push_back(std::move(event));
  }
  return {{"traceEvents", std::move(all)}, {"displayTimeUnit", "ms"}};
}

TraceSpan::TraceSpan(std::string name, const char* category)
    : name_(std::move(name)), category_(category), begin_(Trace::Clock::now()) {}

TraceSpan::~TraceSpan() {
  Trace& trace = Trace::process();
  if (trace.on()) trace.span(std::move(name_), category_, begin_, Trace::Clock::now());
}

}  // namespace meshrun::trace
