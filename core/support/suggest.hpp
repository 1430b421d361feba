// "Did you mean" suggestions for unknown names (config keys, plugins, axes).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace meshrun {

// Edit distance (insertions, deletions, substitutions; each costs 1).
size_t edit_distance(std::string_view a, std::string_view b);

// The candidate closest to `word` if it is close enough to be a plausible
// typo (distance <= max(2, len/3)), else "".
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

// " (did you mean 'x'?)" or "" — ready to append to a message.
std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates);

// "a, b, c" — for "valid: ..." lists.
std::string join_names(const std::vector<std::string>& names);

}  // namespace meshrun
