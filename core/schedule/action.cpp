// Action strings in PyTorch's format, stage placement, and the positions
// errors name. Also built into the schedule plugins (plugins/schedules), so
// it uses nothing but the standard library and this header.
#include <algorithm>
#include <array>
#include <charconv>
#include <string>

#include "schedule/schedule.hpp"

namespace meshrun::schedule {
namespace {

struct TypeName {
  ActionType type;
  std::string_view name;
  bool has_microbatch;  // UNSHARD, RESHARD and REDUCE_GRAD concern the whole stage
};

constexpr std::array<TypeName, 11> kTypeNames = {{
    {ActionType::F, "F", true},
    {ActionType::B, "B", true},
    {ActionType::I, "I", true},
    {ActionType::W, "W", true},
    {ActionType::SEND_F, "SEND_F", true},
    {ActionType::RECV_F, "RECV_F", true},
    {ActionType::SEND_B, "SEND_B", true},
    {ActionType::RECV_B, "RECV_B", true},
    {ActionType::UNSHARD, "UNSHARD", false},
    {ActionType::RESHARD, "RESHARD", false},
    {ActionType::REDUCE_GRAD, "REDUCE_GRAD", false},
}};

const TypeName& type_name(ActionType type) { return kTypeNames[static_cast<size_t>(type)]; }

// The non-negative int32 that is all of `digits`; nullopt for anything else
// (empty, a sign, other characters, overflow).
std::optional<int32_t> parse_index(std::string_view digits) {
  if (digits.empty() || digits.front() < '0' || digits.front() > '9') return std::nullopt;
  int32_t value = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (error != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return value;
}

}  // namespace

bool is_compute(ActionType type) {
  return type == ActionType::F || type == ActionType::B || type == ActionType::I ||
         type == ActionType::W;
}

bool is_communication(ActionType type) {
  return type == ActionType::SEND_F || type == ActionType::RECV_F || type == ActionType::SEND_B ||
         type == ActionType::RECV_B;
}

std::string format_action(const Action& action) {
  const TypeName& type = type_name(action.type);
  std::string text = std::to_string(action.stage);
  text += type.name;
  if (type.has_microbatch) text += std::to_string(action.microbatch);
  return text;
}

std::optional<Action> parse_action(std::string_view text) {
  const size_t digits = text.find_first_not_of("0123456789");
  if (digits == 0 || digits == std::string_view::npos) return std::nullopt;
  const std::optional<int32_t> stage = parse_index(text.substr(0, digits));
  if (!stage) return std::nullopt;
  const std::string_view rest = text.substr(digits);
  for (const TypeName& type : kTypeNames) {
    if (!rest.starts_with(type.name)) continue;
    const std::string_view tail = rest.substr(type.name.size());
    if (!type.has_microbatch) {
      if (!tail.empty()) continue;
      return Action{*stage, type.type, -1};
    }
    if (const std::optional<int32_t> microbatch = parse_index(tail)) {
      return Action{*stage, type.type, *microbatch};
    }
  }
  return std::nullopt;
}

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
