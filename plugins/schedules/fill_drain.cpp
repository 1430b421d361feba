// Fill-drain schedules: every forward of a rank, then every backward.
// GPipe holds one stage per rank and runs backwards in microbatch order;
// Looped BFS (breadth-first, Lamy-Poirier 2022) loops v stages over the
// ranks, runs every microbatch through one local stage before the next, and
// unwinds in exactly the reverse order.
#include "schedules/generators.hpp"

namespace meshrun::schedules {

RankActions gpipe(const Sizes& sizes) {
  require_stages_per_rank("gpipe", sizes, 1, "one stage per rank");
  RankActions ranks(static_cast<size_t>(sizes.pp));
  for (int32_t rank = 0; rank < sizes.pp; ++rank) {
    std::vector<Action>& actions = ranks[static_cast<size_t>(rank)];
    for (int32_t mb = 0; mb < sizes.microbatches; ++mb)
      actions.push_back({rank, ActionType::F, mb});
    for (int32_t mb = 0; mb < sizes.microbatches; ++mb)
      actions.push_back({rank, ActionType::B, mb});
  }
  return ranks;
}

RankActions looped_bfs(const Sizes& sizes) {
  RankActions ranks(static_cast<size_t>(sizes.pp));
  const auto m = static_cast<int32_t>(sizes.microbatches);
  const auto stages = static_cast<int32_t>(sizes.pp * sizes.stages_per_rank);
  const auto pp = static_cast<int32_t>(sizes.pp);
  for (int32_t rank = 0; rank < pp; ++rank) {
    std::vector<Action>& actions = ranks[static_cast<size_t>(rank)];
    for (int32_t stage = rank; stage < stages; stage += pp) {
      for (int32_t mb = 0; mb < m; ++mb) actions.push_back({stage, ActionType::F, mb});
    }
    for (int32_t stage = stages - pp + rank; stage >= 0; stage -= pp) {
      for (int32_t mb = m - 1; mb >= 0; --mb) actions.push_back({stage, ActionType::B, mb});
    }
  }
  return ranks;
}

}  // namespace meshrun::schedules
