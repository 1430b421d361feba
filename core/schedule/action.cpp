// Stage placement, and the positions errors name.
#include <algorithm>
#include <string>

#include "schedule/schedule.hpp"

namespace meshrun::schedule {

std::vector<int64_t> loop_placement(int64_t pp, int64_t stages_per_rank) {
  std::vector<int64_t> stage_rank(static_cast<size_t>(pp * stages_per_rank));
  for (size_t stage = 0; stage < stage_rank.size(); ++stage) {
    stage_rank[stage] = static_cast<int64_t>(stage) % pp;
  }
  return stage_rank;
}

std::vector<int64_t> v_placement(int64_t pp) {
  std::vector<int64_t> stage_rank(static_cast<size_t>(2 * pp));
  for (int64_t rank = 0; rank < pp; ++rank) {
    stage_rank[static_cast<size_t>(rank)] = rank;
    stage_rank[static_cast<size_t>(2 * pp - 1 - rank)] = rank;
  }
  return stage_rank;
}

std::string position(const Schedule& schedule, int64_t rank, int64_t step) {
  const std::string text = "rank " + std::to_string(rank) + " step " + std::to_string(step);
  if (schedule.csv_path.empty() || rank < 0 ||
      rank >= static_cast<int64_t>(schedule.csv_columns.size())) {
    return text;
  }
  const std::string row = text + " (" + schedule.csv_path + " row " + std::to_string(rank + 1);
  const std::vector<int64_t>& columns = schedule.csv_columns[static_cast<size_t>(rank)];
  const int64_t size = static_cast<int64_t>(columns.size());
  if (step >= 0 && step < size && columns[static_cast<size_t>(step)] > 0) {
    return row + ", column " + std::to_string(columns[static_cast<size_t>(step)]) + ")";
  }
  // An added action, or the end of the list: name the file's cell before it.
  int64_t before = std::min(step, size) - 1;
  while (before >= 0 && columns[static_cast<size_t>(before)] == 0) --before;
  const int64_t before_column = before >= 0 ? columns[static_cast<size_t>(before)] : 0;
  if (step >= size) {
    return row + ", column " + std::to_string(before_column + 1) + ": the end of the row)";
  }
  if (before < 0) return row + ", before its first cell)";
  return row + ", after column " + std::to_string(before_column) + ")";
}

}  // namespace meshrun::schedule
