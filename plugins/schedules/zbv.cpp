// ZBV zero bubble (Qi et al. 2023, section 6): two stages per rank in a V
// (rank r holds stage r on the way down and 2pp-1-r on the way back), the
// backward split into I and W, and Ws placed so that with F = I = W every
// rank stays busy. PyTorch's ScheduleZBVZeroBubble: its phases are sized
// for at least 2pp-1 microbatches, and with fewer the actions of the
// microbatches that do not exist are left out.
#include <algorithm>
#include <array>

#include "schedules/generators.hpp"

namespace meshrun::schedules {
namespace {

// Emits one rank's actions, counting per local stage (0: down, 1: up) the
// next microbatch of each of F, I and W.
class VRank {
 public:
  VRank(const Sizes& sizes, int32_t rank)
      : stages_{rank, static_cast<int32_t>(2 * sizes.pp - 1 - rank)},
        microbatches_(sizes.microbatches) {}

  void add(int local, ActionType type) {
    int32_t& next = next_[static_cast<size_t>(local)][slot(type)];
    if (next < microbatches_) actions_.push_back({stages_[static_cast<size_t>(local)], type, next});
    ++next;
  }
  // F, I and W of the local stage.
  void forward_backward(int local) {
    add(local, ActionType::F);
    add(local, ActionType::I);
    add(local, ActionType::W);
  }
  int32_t count(int local, ActionType type) const {
    return next_[static_cast<size_t>(local)][slot(type)];
  }
  std::vector<Action> take() { return std::move(actions_); }

 private:
  static size_t slot(ActionType type) {
    return type == ActionType::F ? 0 : type == ActionType::I ? 1 : 2;
  }

  std::array<int32_t, 2> stages_;
  int64_t microbatches_;
  std::array<std::array<int32_t, 3>, 2> next_{};
  std::vector<Action> actions_;
};

std::vector<Action> zbv_rank(const Sizes& sizes, int32_t rank) {
  const auto pp = static_cast<int32_t>(sizes.pp);
  const auto padded = static_cast<int32_t>(std::max<int64_t>(2 * sizes.pp - 1, sizes.microbatches));
  VRank v(sizes, rank);
  // Warm-up: fill the way down, then alternate with the way up, then start
  // the way up's backwards as soon as the last stage's loss exists.
  for (int32_t i = 0; i < 2 * (pp - rank) - 1; ++i) v.add(0, ActionType::F);
  for (int32_t i = 0; i < rank; ++i) {
    v.add(1, ActionType::F);
    v.add(0, ActionType::F);
  }
  for (int32_t i = 0; i < pp - rank; ++i) v.forward_backward(1);
  // Steady state: a forward and a full split backward on each leg.
  while (v.count(1, ActionType::F) < v.count(0, ActionType::F) ||
         v.count(0, ActionType::F) < padded) {
    if (v.count(0, ActionType::F) < padded) v.add(0, ActionType::F);
    v.add(0, ActionType::I);
    v.add(0, ActionType::W);
    v.forward_backward(1);
  }
  // Cool-down: the Is on the critical path first, the Ws they leave behind
  // fill the time the last backwards travel.
  for (int32_t i = 0; i < rank; ++i) {
    v.add(0, ActionType::I);
    v.add(1, ActionType::I);
  }
  for (int32_t i = 0; i < pp - rank; ++i) {
    v.add(0, ActionType::I);
    v.add(0, ActionType::W);
  }
  while (v.count(1, ActionType::W) < v.count(1, ActionType::I)) v.add(1, ActionType::W);
  while (v.count(0, ActionType::W) < v.count(0, ActionType::I)) v.add(0, ActionType::W);
  return v.take();
}

}  // namespace

RankActions zbv_zero_bubble(const Sizes& sizes) {
  require_stages_per_rank("zbv_zero_bubble", sizes, 2, "V placement");
  RankActions ranks;
  for (int32_t rank = 0; rank < sizes.pp; ++rank) ranks.push_back(zbv_rank(sizes, rank));
  return ranks;
}

}  // namespace meshrun::schedules
