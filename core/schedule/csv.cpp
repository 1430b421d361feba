// Schedules from PyTorch's CSV format (pp_schedule_csv, as written by
// PipelineScheduleMulti._dump_csv): one row per rank, one cell per time
// step, an empty cell idle. Every error names the file, row and column.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "errors.hpp"
#include "schedule/schedule.hpp"
#include "support/input_file.hpp"

namespace meshrun::schedule {
namespace {

std::string trim(std::string_view text) {
  const size_t begin = text.find_first_not_of(" \t\r");
  if (begin == std::string_view::npos) return {};
  const size_t end = text.find_last_not_of(" \t\r");
  std::string cell(text.substr(begin, end - begin + 1));
  // A CSV writer may quote any cell; actions never hold a comma or a quote.
  if (cell.size() >= 2 && cell.front() == '"' && cell.back() == '"') {
    cell = trim(std::string_view(cell).substr(1, cell.size() - 2));
  }
  return cell;
}

// The file's rows of trimmed cells.
std::vector<std::vector<std::string>> read_rows(const std::string& path) {
  if (const auto problem = unreadable_input_file(path, kMaxScheduleCsvBytes)) {
    throw Error(MESHRUN_INVALID_ARGUMENT, "schedule CSV: " + *problem);
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error(MESHRUN_NOT_FOUND,
                fmt::format("cannot read the schedule CSV {}: {}", path, std::strerror(errno)));
  }
  std::vector<std::vector<std::string>> rows;
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    size_t begin = 0;
    for (size_t comma = line.find(','); comma != std::string::npos;
         begin = comma + 1, comma = line.find(',', begin)) {
      cells.push_back(trim(std::string_view(line).substr(begin, comma - begin)));
    }
    cells.push_back(trim(std::string_view(line).substr(begin)));
    rows.push_back(std::move(cells));
  }
  // Blank lines at the end are no ranks: every rank has actions to run.
  const auto blank = [](const std::vector<std::string>& row) {
    return std::all_of(row.begin(), row.end(),
                       [](const std::string& cell) { return cell.empty(); });
  };
  while (!rows.empty() && blank(rows.back())) rows.pop_back();
  return rows;
}

[[noreturn]] void fail_cell(const std::string& path, size_t row, size_t column,
                            const std::string& what) {
  throw invalid_argument(fmt::format("{} row {}, column {}: {}", path, row + 1, column + 1, what));
}

std::optional<Action> parse_cell(const std::string& path, size_t row, size_t column,
                                 const std::string& cell, int64_t stages) {
  if (cell.empty()) return std::nullopt;
  const std::optional<Action> action = parse_action(cell);
  if (!action) {
    fail_cell(path, row, column,
              fmt::format("'{}' is not an action: expected [stage][type][microbatch] with type "
                          "F, B, I, W, SEND_F, RECV_F, SEND_B or RECV_B (e.g. 2F0, 1SEND_B3), or "
                          "[stage]UNSHARD, RESHARD or REDUCE_GRAD",
                          cell));
  }
  if (action->stage >= stages) {
    fail_cell(path, row, column,
              fmt::format("{}: stage {} does not exist (pp * stages_per_rank = {} stages)", cell,
                          action->stage, stages));
  }
  return action;
}

// The rank of every stage: the row where it first appears, or, for stages
// the file never names, what the loop (or else V) placement says, taking
// the first of them that agrees with every stage the file does name.
std::vector<int64_t> placement_of(const Schedule& schedule) {
  std::vector<int64_t> seen(static_cast<size_t>(schedule.stages()), -1);
  for (int64_t rank = 0; rank < schedule.pp; ++rank) {
    for (const auto& action : schedule.ranks[static_cast<size_t>(rank)]) {
      if (action && seen[static_cast<size_t>(action->stage)] < 0) {
        seen[static_cast<size_t>(action->stage)] = rank;
      }
    }
  }
  std::vector<std::vector<int64_t>> defaults = {
      loop_placement(schedule.pp, schedule.stages_per_rank)};
  if (schedule.stages_per_rank == 2) defaults.push_back(v_placement(schedule.pp));
  std::vector<int64_t> fallback = defaults.front();
  for (const auto& candidate : defaults) {
    bool agrees = true;
    for (size_t stage = 0; stage < seen.size(); ++stage) {
      agrees = agrees && (seen[stage] < 0 || seen[stage] == candidate[stage]);
    }
    if (agrees) {
      fallback = candidate;
      break;
    }
  }
  for (size_t stage = 0; stage < seen.size(); ++stage) {
    if (seen[stage] < 0) seen[stage] = fallback[stage];
  }
  return seen;
}

Schedule parse_schedule(const std::string& path, int64_t pp, int64_t stages_per_rank,
                        int64_t microbatches) {
  const std::vector<std::vector<std::string>> rows = read_rows(path);
  if (static_cast<int64_t>(rows.size()) != pp) {
    throw invalid_argument(fmt::format(
        "{}: {} rows, but a schedule for pp {} needs one row per rank", path, rows.size(), pp));
  }
  Schedule schedule;
  schedule.name = "csv";
  schedule.pp = pp;
  schedule.stages_per_rank = stages_per_rank;
  schedule.microbatches = microbatches;
  schedule.csv_path = path;
  schedule.ranks.resize(rows.size());
  schedule.csv_columns.resize(rows.size());
  schedule.stage_rank.resize(static_cast<size_t>(pp * stages_per_rank));
  for (size_t row = 0; row < rows.size(); ++row) {
    for (size_t column = 0; column < rows[row].size(); ++column) {
      schedule.ranks[row].push_back(
          parse_cell(path, row, column, rows[row][column], schedule.stages()));
      schedule.csv_columns[row].push_back(static_cast<int64_t>(column + 1));
    }
  }
  schedule.stage_rank = placement_of(schedule);
  return schedule;
}

bool has_communication(const Schedule& schedule) {
  for (const auto& list : schedule.ranks) {
    for (const auto& action : list) {
      if (action && is_communication(action->type)) return true;
    }
  }
  return false;
}

}  // namespace

Schedule read_csv(const std::string& path, int64_t pp, int64_t stages_per_rank,
                  int64_t microbatches) {
  if (pp < 1 || stages_per_rank < 1 || microbatches < 1) {
    throw invalid_argument(
        fmt::format("{}: pp, stages_per_rank and microbatches must be at "
                    "least 1, got {}, {} and {}",
                    path, pp, stages_per_rank, microbatches));
  }
  Schedule schedule = parse_schedule(path, pp, stages_per_rank, microbatches);
  if (!has_communication(schedule)) schedule = lower(schedule);
  validate(schedule);
  return schedule;
}

}  // namespace meshrun::schedule
