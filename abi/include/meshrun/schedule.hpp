// meshrun/schedule.hpp — header-only C++ helper for schedule plugin authors,
// and the host's own vocabulary of pipeline actions.
//
// A schedule plugin (meshrun/schedule.h) returns each rank's actions as
// PyTorch's action strings (torch.distributed.pipelining): the global stage,
// the type, and the microbatch, "2F0", "1B3", "0I1", "0W1". The host adds
// communication ("3SEND_F2", "1RECV_B0") and a sharded strategy's work
// ("0UNSHARD", "0RESHARD", "2REDUCE_GRAD", which concern a whole stage and
// carry no microbatch). This header is that vocabulary as C++ values and the
// two conversions, so that both sides of the ABI read and write it alike.
// Nothing here needs libmeshrun.
#ifndef MESHRUN_SCHEDULE_HPP_
#define MESHRUN_SCHEDULE_HPP_

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

namespace meshrun::schedule {

// PyTorch's _ComputationType. B is a full backward; I and W are its input
// and weight halves (zero-bubble schedules). UNSHARD, RESHARD and
// REDUCE_GRAD are a sharded data-parallel strategy's work for a stage.
enum class ActionType : int32_t {
  F,
  B,
  I,
  W,
  SEND_F,
  RECV_F,
  SEND_B,
  RECV_B,
  UNSHARD,
  RESHARD,
  REDUCE_GRAD,
};

// One action: `stage` (the global stage index) does `type` for `microbatch`
// (-1 for UNSHARD, RESHARD and REDUCE_GRAD, which concern the whole stage).
struct Action {
  int32_t stage = 0;
  ActionType type = ActionType::F;
  int32_t microbatch = -1;
};

inline bool operator==(const Action& a, const Action& b) {
  return a.stage == b.stage && a.type == b.type && a.microbatch == b.microbatch;
}
inline bool operator!=(const Action& a, const Action& b) { return !(a == b); }

// F, B, I, W.
inline bool is_compute(ActionType type) {
  return type == ActionType::F || type == ActionType::B || type == ActionType::I ||
         type == ActionType::W;
}

// SEND_F, RECV_F, SEND_B, RECV_B.
inline bool is_communication(ActionType type) {
  return type == ActionType::SEND_F || type == ActionType::RECV_F || type == ActionType::SEND_B ||
         type == ActionType::RECV_B;
}

namespace action_text {

struct TypeName {
  ActionType type;
  std::string_view name;
  bool has_microbatch;
};

// In ActionType's order.
inline constexpr std::array<TypeName, 11> kTypeNames = {{
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

// The non-negative int32 that is all of `digits`; nullopt for anything else
// (empty, a sign, other characters, overflow).
inline std::optional<int32_t> parse_index(std::string_view digits) {
  if (digits.empty() || digits.front() < '0' || digits.front() > '9') return std::nullopt;
  int32_t value = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (error != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return value;
}

}  // namespace action_text

// The action's string: "2F0", "3SEND_F2", "0UNSHARD".
inline std::string format_action(const Action& action) {
  const action_text::TypeName& type = action_text::kTypeNames[static_cast<size_t>(action.type)];
  std::string text = std::to_string(action.stage);
  text += type.name;
  if (type.has_microbatch) text += std::to_string(action.microbatch);
  return text;
}

// The action a string names; nullopt when it is not one.
inline std::optional<Action> parse_action(std::string_view text) {
  const size_t digits = text.find_first_not_of("0123456789");
  if (digits == 0 || digits == std::string_view::npos) return std::nullopt;
  const std::optional<int32_t> stage = action_text::parse_index(text.substr(0, digits));
  if (!stage) return std::nullopt;
  const std::string_view rest = text.substr(digits);
  for (const action_text::TypeName& type : action_text::kTypeNames) {
    if (rest.substr(0, type.name.size()) != type.name) continue;
    const std::string_view tail = rest.substr(type.name.size());
    if (!type.has_microbatch) {
      if (!tail.empty()) continue;
      return Action{*stage, type.type, -1};
    }
    if (const std::optional<int32_t> microbatch = action_text::parse_index(tail)) {
      return Action{*stage, type.type, *microbatch};
    }
  }
  return std::nullopt;
}

}  // namespace meshrun::schedule

#endif  // MESHRUN_SCHEDULE_HPP_
