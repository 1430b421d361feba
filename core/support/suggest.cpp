#include "support/suggest.hpp"

#include <algorithm>
#include <numeric>

namespace meshrun {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  std::iota(row.begin(), row.end(), size_t{0});
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitution = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitution});
    }
  }
  return row[b.size()];
}

std::string closest_match(std::string_view word, const std::vector<std::string>& candidates) {
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  std::string best;
  size_t best_distance = limit + 1;
  for (const auto& candidate : candidates) {
    const size_t distance = edit_distance(word, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  return best;
}

std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates) {
  const std::string match = closest_match(word, candidates);
  return match.empty() ? std::string() : " (did you mean '" + match + "'?)";
}

std::string join_names(const std::vector<std::string>& names) {
  std::string joined;
  for (const auto& name : names) {
    if (!joined.empty()) joined += ", ";
    joined += name;
  }
  return joined;
}

}  // namespace meshrun
