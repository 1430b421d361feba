#include "launch/mpirun_output.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <functional>
#include <regex>

namespace meshrun::launch {
namespace {

enum class TagMatch { none, partial, full };

struct Tag {
  TagMatch match = TagMatch::none;
  size_t length = 0;
  int64_t rank = 0;
  OutputStream stream = OutputStream::out;
};

// Reads "[JOB,RANK]<NAME>:" at the start of `text` (which starts with '[').
// `partial` when `text` ends inside what could still become a tag.
class TagReader {
 public:
  explicit TagReader(std::string_view text) : text_(text) {}

  Tag read() {
    std::string_view name;
    int64_t rank = 0;
    if (!literal('[') || !number(nullptr) || !literal(',') || !number(&rank) || !literal(']') ||
        !literal('<') || !word(&name) || !literal('>') || !literal(':')) {
      return {truncated_ ? TagMatch::partial : TagMatch::none};
    }
    if (name == "stdout") return {TagMatch::full, pos_, rank, OutputStream::out};
    if (name == "stderr" || name == "stddiag")
      return {TagMatch::full, pos_, rank, OutputStream::err};
    return {};
  }

 private:
  bool at_end() {
    truncated_ = pos_ >= text_.size();
    return truncated_;
  }
  bool literal(char c) {
    if (at_end() || text_[pos_] != c) return false;
    ++pos_;
    return true;
  }
  bool number(int64_t* value) {
    const size_t start = pos_;
    int64_t parsed = 0;
    while (!at_end() && std::isdigit(static_cast<unsigned char>(text_[pos_])) &&
           pos_ - start < 18) {
      parsed = parsed * 10 + (text_[pos_++] - '0');
    }
    if (value != nullptr) *value = parsed;
    return pos_ > start && !truncated_;
  }
  bool word(std::string_view* value) {
    const size_t start = pos_;
    while (!at_end() && std::islower(static_cast<unsigned char>(text_[pos_])) && pos_ - start < 8) {
      ++pos_;
    }
    *value = text_.substr(start, pos_ - start);
    return pos_ > start && !truncated_;
  }

  std::string_view text_;
  size_t pos_ = 0;
  bool truncated_ = false;
};

int status_from_code(const std::string& code) {
  const long value = std::stol(code);
  return value >= 1 && value <= 255 ? static_cast<int>(value) : 1;
}

std::string on_node(const std::string& node, bool name_nodes) {
  return name_nodes ? " on node " + node : "";
}

std::vector<std::string> split_lines(std::string_view text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < text.size()) {
    const size_t end = std::min(text.find('\n', start), text.size());
    lines.emplace_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

// The ranks of the application job (not job 0, mpirun's daemons) whose
// state in mpirun's --report-state-on-timeout table is not TERMINATED.
std::vector<std::string> ranks_still_running(std::string_view text) {
  static const std::regex job(R"(DATA FOR JOB: \[\d+,(\d+)\])");
  static const std::regex proc(R"(Rank: (\d+)\s+Node: \S+\s+PID: \d+\s+State: ([^\t]*))");
  std::vector<std::string> ranks;
  bool application = false;
  for (const std::string& line : split_lines(text)) {
    std::smatch match;
    if (std::regex_search(line, match, job)) {
      application = match[1] != "0";
    } else if (application && std::regex_search(line, match, proc) &&
               match[2].str().find("TERMINATED") == std::string::npos) {
      ranks.push_back(match[1]);
    }
  }
  return ranks;
}

using Match = std::smatch;

struct FailurePattern {
  std::regex pattern;
  std::function<JobFailure(const Match&, bool name_nodes, std::string_view text)> describe;
};

// In order of precedence: when mpirun stops a job for a time limit or an
// MPI_Abort, other ranks' deaths are consequences, not causes.
const std::vector<FailurePattern>& failure_patterns() {
  static const std::vector<FailurePattern> patterns = {
      {std::regex(R"(time limit for job execution has been reached:\s+Timeout:\s+(\d+) seconds)"),
       [](const Match& m, bool, std::string_view text) {
         const auto running = ranks_still_running(text);
         std::string message = fmt::format("the job timed out after {} s", m[1].str());
         if (!running.empty()) {
           message += fmt::format("; ranks still running: {}", fmt::join(running, ", "));
         }
         return JobFailure{message, 124};
       }},
      {std::regex(
           R"(MPI_ABORT was invoked on rank (\d+) in communicator \S+\s+with errorcode (-?\d+))"),
       [](const Match& m, bool, std::string_view) {
         return JobFailure{
             fmt::format("rank {} called MPI_Abort with error code {}", m[1].str(), m[2].str()),
             status_from_code(m[2])};
       }},
      {std::regex(
           R"(process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)( \([^)]*\))?)"),
       [](const Match& m, bool name_nodes, std::string_view) {
         return JobFailure{fmt::format("rank {}{} exited on signal {}{}", m[1].str(),
                                       on_node(m[2], name_nodes), m[3].str(), m[4].str()),
                           128 + std::stoi(m[3])};
       }},
      {std::regex(R"(Process name: \[\[\d+,\d+\],(\d+)\]\s+Exit code:\s+(-?\d+))"),
       [](const Match& m, bool, std::string_view) {
         return JobFailure{fmt::format("rank {} exited with status {}", m[1].str(), m[2].str()),
                           status_from_code(m[2])};
       }},
      {std::regex(R"(process rank (\d+) with PID \d+ on\s+node (\S+) exiting improperly)"),
       [](const Match& m, bool name_nodes, std::string_view) {
         return JobFailure{fmt::format("rank {}{} exited without calling MPI_Finalize while other "
                                       "ranks were still running",
                                       m[1].str(), on_node(m[2], name_nodes)),
                           1};
       }},
      {std::regex(
           R"(could not access\s+or execute an executable:\s+Executable:\s+(\S+)\s+Node:\s+(\S+))"),
       [](const Match& m, bool name_nodes, std::string_view) {
         return JobFailure{fmt::format("cannot run '{}'{}: not found or not executable", m[1].str(),
                                       on_node(m[2], name_nodes)),
                           2};
       }},
      {std::regex(R"(unable to open the hostfile:\s+(\S+))"),
       [](const Match& m, bool, std::string_view) {
         return JobFailure{fmt::format("cannot open hostfile '{}'", m[1].str()), 2};
       }},
      {std::regex(R"(not enough slots available in the system to satisfy the (\d+)\s+slots)"),
       [](const Match& m, bool, std::string_view) {
         return JobFailure{fmt::format("the hosts have fewer slots than the {} ranks asked for; "
                                       "raise slots=N in the hostfile",
                                       m[1].str()),
                           2};
       }},
  };
  return patterns;
}

bool is_rule(const std::string& line) {
  return line.size() >= 20 && line.find_first_not_of('-') == std::string::npos;
}

bool ends_with(const std::string& text, std::string_view suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A banner mpirun prints because the job is failing.
bool is_failure_banner(const std::string& text) {
  return text.find("Per user-direction, the job has been aborted") != std::string::npos ||
         summarize_mpirun_messages(text).has_value();
}

}  // namespace

std::vector<OutputLine> TaggedOutputDecoder::feed(std::string_view bytes) {
  pending_.append(bytes);
  std::vector<OutputLine> lines;
  pending_.erase(0, consume(pending_, lines));
  return lines;
}

std::vector<OutputLine> TaggedOutputDecoder::finish() {
  std::vector<OutputLine> lines;
  // A tag cut short at the end of the output is text after all.
  append(pending_);
  pending_.clear();
  for (auto& [owner, text] : partial_) {
    if (text.empty()) continue;
    lines.push_back({owner.first < 0 ? std::nullopt : std::optional<int64_t>(owner.first),
                     owner.second, std::move(text)});
  }
  partial_.clear();
  owner_.reset();
  return lines;
}

size_t TaggedOutputDecoder::consume(std::string_view text, std::vector<OutputLine>& lines) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (text[pos] == '\n') {
      end_line(lines);
      ++pos;
      continue;
    }
    if (text[pos] == '[') {
      const Tag tag = TagReader(text.substr(pos)).read();
      if (tag.match == TagMatch::partial) break;
      if (tag.match == TagMatch::full) {
        owner_ = Owner{tag.rank, tag.stream};
        pos += tag.length;
        continue;
      }
    }
    const size_t stop = std::min(text.find_first_of("[\n", pos + 1), text.size());
    append(text.substr(pos, stop - pos));
    pos = stop;
  }
  return pos;
}

void TaggedOutputDecoder::append(std::string_view text) {
  if (text.empty()) return;
  if (!owner_) owner_ = Owner{-1, pipe_stream_};
  partial_[*owner_].append(text);
}

void TaggedOutputDecoder::end_line(std::vector<OutputLine>& lines) {
  const Owner owner = owner_.value_or(Owner{-1, pipe_stream_});
  const auto found = partial_.find(owner);
  std::string text = found == partial_.end() ? std::string() : std::move(found->second);
  if (found != partial_.end()) partial_.erase(found);
  lines.push_back({owner.first < 0 ? std::nullopt : std::optional<int64_t>(owner.first),
                   owner.second, std::move(text)});
  owner_.reset();
}

std::string rank_line(int64_t rank, std::string_view text) {
  if (rank == 0) return std::string(text);
  return fmt::format("[rank {}] {}", rank, text);
}

std::optional<JobFailure> summarize_mpirun_messages(std::string_view text, bool name_nodes) {
  const std::string subject(text);
  for (const FailurePattern& failure : failure_patterns()) {
    Match match;
    if (std::regex_search(subject, match, failure.pattern)) {
      return failure.describe(match, name_nodes, text);
    }
  }
  return std::nullopt;
}

std::vector<std::string> MpirunMessages::add(const std::string& line) {
  if (is_rule(line)) {
    banner_.push_back(line);
    in_banner_ = !in_banner_;
    return in_banner_ ? std::vector<std::string>{} : close_banner();
  }
  if (in_banner_) {
    banner_.push_back(line);
    return {};
  }
  // mpirun's state report (on a time limit) is a block of tab-indented lines.
  if (line.rfind("DATA FOR JOB", 0) == 0) {
    in_state_report_ = true;
  } else if (in_state_report_ && !line.empty() && line[0] != '\t') {
    in_state_report_ = false;
  }
  if (holding_ || in_state_report_ || ends_with(line, "total processes failed to start")) {
    hold(line);
    return {};
  }
  return {line};
}

std::vector<std::string> MpirunMessages::finish() {
  in_banner_ = false;
  return close_banner();
}

std::vector<std::string> MpirunMessages::close_banner() {
  std::vector<std::string> banner = std::move(banner_);
  banner_.clear();
  std::string text;
  for (const std::string& line : banner) text += line + '\n';
  if (!holding_ && !is_failure_banner(text)) return banner;
  holding_ = true;
  held_ += text;
  return {};
}

void MpirunMessages::hold(const std::string& line) { held_ += line + '\n'; }

}  // namespace meshrun::launch
