// Reading what `mpirun --tag-output` prints.
//
// Ranks' output arrives in chunks tagged "[JOB,RANK]<stdout>:" (or
// <stderr>:, <stddiag>:). A chunk need not end a line: a line written in two
// pieces shows up as two tagged chunks, possibly with other ranks' chunks in
// between. mpirun's own messages are untagged, mostly multi-line banners
// between rules of dashes; on a failure they explain which rank failed and
// how. These pieces turn that into whole lines per rank and condense the
// failure banners into one line.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace meshrun::launch {

enum class OutputStream { out, err };

struct OutputLine {
  std::optional<int64_t> rank;  // std::nullopt: mpirun's own line
  OutputStream stream = OutputStream::out;
  std::string text;  // without the newline
};

// Splits one of mpirun's pipes into whole lines. Untagged text belongs to
// the pipe's own stream; tagged text to the stream its tag names.
class TaggedOutputDecoder {
 public:
  explicit TaggedOutputDecoder(OutputStream pipe_stream) : pipe_stream_(pipe_stream) {}

  // The lines completed by `bytes`.
  std::vector<OutputLine> feed(std::string_view bytes);
  // At end of file: every unfinished line, as if it ended.
  std::vector<OutputLine> finish();

 private:
  // (rank or -1 for mpirun itself, stream)
  using Owner = std::pair<int64_t, OutputStream>;

  void append(std::string_view text);
  void end_line(std::vector<OutputLine>& lines);
  size_t consume(std::string_view text, std::vector<OutputLine>& lines);

  OutputStream pipe_stream_;
  std::string pending_;         // bytes that may start a tag not yet complete
  std::optional<Owner> owner_;  // whose text comes next; none at line start
  std::map<Owner, std::string> partial_;
};

// What the user sees of a rank's line: rank 0's as is, "[rank N] text" for
// the others.
std::string rank_line(int64_t rank, std::string_view text);

// Why a job ended, condensed from mpirun's messages.
struct JobFailure {
  std::string message;  // e.g. "rank 1 exited on signal 9 (Killed)"
  int exit_status = 1;  // what the launcher should exit with
};

// The reason mpirun gives in `text` (its own messages, any number of lines)
// for ending the job: a job time limit reached (with the ranks still
// running), MPI_Abort, a rank killed by a signal, a rank's non-zero exit,
// a rank exiting without MPI_Finalize, an executable or hostfile it could
// not use, too few slots. std::nullopt when it gives none of these.
// `name_nodes` adds the node to the message where mpirun names it (useful
// only with several nodes).
std::optional<JobFailure> summarize_mpirun_messages(std::string_view text, bool name_nodes = false);

// mpirun's own lines as they arrive: which to show at once and which to hold
// back. Banners about a failure, and everything mpirun says after one, are
// held: the launcher replaces them with one line from
// summarize_mpirun_messages(held()). Other banners (warnings) are shown once
// complete.
class MpirunMessages {
 public:
  // The lines to show now (possibly none, possibly a whole banner).
  std::vector<std::string> add(const std::string& line);
  // At the end: an unfinished banner, to show now unless held.
  std::vector<std::string> finish();
  // Everything held back, one line per '\n'.
  const std::string& held() const { return held_; }

 private:
  std::vector<std::string> close_banner();
  void hold(const std::string& line);

  bool holding_ = false;
  bool in_banner_ = false;
  bool in_state_report_ = false;
  std::vector<std::string> banner_;
  std::string held_;
};

}  // namespace meshrun::launch
