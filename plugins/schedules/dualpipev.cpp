// DualPipeV (DeepSeek-V3, as in PyTorch's ScheduleDualPipeV): two stages
// per rank in a V; in the main phase every rank pairs the forward of one leg
// with the full backward of the other (DeepSeek overlaps the pair's compute
// with its communication; here the pair is F then B), and the tail splits
// backwards into I and W so that the Ws fill the drain. PyTorch's
// OVERLAP_F_B actions are written out as their F and B.
#include <array>
#include <deque>

#include "schedules/generators.hpp"

namespace meshrun::schedules {
namespace {

// Emits one rank's actions, counting per local stage (0: down, 1: up) the
// next microbatch of F and of backward (a B counts for both I and W), and
// queueing the Ws of the Is not yet completed.
class DualRank {
 public:
  DualRank(const Sizes& sizes, int32_t rank)
      : stages_{rank, static_cast<int32_t>(2 * sizes.pp - 1 - rank)} {}

  void forward(int local) { emit(local, ActionType::F, next_forward_); }
  // B, or I with its W queued.
  void backward(int local, bool split) {
    if (!split) {
      emit(local, ActionType::B, next_backward_);
      return;
    }
    emit(local, ActionType::I, next_backward_);
    pending_weights_.push_back({actions_.back().stage, ActionType::W, actions_.back().microbatch});
  }
  // The forward of one leg paired with the full backward of the other.
  void forward_backward(int forward_local, int backward_local) {
    forward(forward_local);
    backward(backward_local, false);
  }
  // The oldest queued W, if any.
  void weight() {
    if (pending_weights_.empty()) return;
    actions_.push_back(pending_weights_.front());
    pending_weights_.pop_front();
  }
  std::vector<Action> take() { return std::move(actions_); }

 private:
  void emit(int local, ActionType type, std::array<int32_t, 2>& next) {
    const auto slot = static_cast<size_t>(local);
    actions_.push_back({stages_[slot], type, next[slot]++});
  }

  std::array<int32_t, 2> stages_;
  std::array<int32_t, 2> next_forward_{};
  std::array<int32_t, 2> next_backward_{};
  std::deque<Action> pending_weights_;
  std::vector<Action> actions_;
};

std::vector<Action> dualpipev_rank(const Sizes& sizes, int32_t rank) {
  const auto pp = static_cast<int32_t>(sizes.pp);
  const auto m = static_cast<int32_t>(sizes.microbatches);
  const int32_t down_hops = pp - rank - 1;  // ranks below on the way down
  DualRank d(sizes, rank);
  // Warm-up: the way down, then both legs, then the way up's first
  // backwards split so their Ws can wait.
  for (int32_t i = 0; i < 2 * down_hops; ++i) d.forward(0);
  for (int32_t i = 0; i < rank + 1; ++i) {
    d.forward(0);
    d.forward(1);
  }
  for (int32_t i = 0; i < down_hops; ++i) {
    d.backward(1, true);
    d.weight();
    d.forward(1);
  }
  // Main phase: F of one leg with B of the other, both ways. The last rank's
  // first pair is not overlapped in DualPipe, which changes nothing here.
  for (int32_t i = 0; i < m - 2 * pp + rank + 1; ++i) {
    d.forward_backward(0, 1);
    d.forward_backward(1, 0);
  }
  for (int32_t i = 0; i < down_hops; ++i) {
    d.backward(1, false);
    d.forward_backward(1, 0);
  }
  // Drain: backwards of both legs, the second half split (odd ranks switch
  // before the up leg's backward, even ranks after it).
  bool split = false;
  for (int32_t i = 0; i < rank + 1; ++i) {
    const bool halfway = i == (rank + 1) / 2;
    if (halfway && rank % 2 == 1) split = true;
    d.backward(1, split);
    if (halfway && rank % 2 == 0) split = true;
    d.backward(0, split);
  }
  for (int32_t i = 0; i < down_hops; ++i) {
    d.weight();
    d.backward(0, split);
  }
  for (int32_t i = 0; i < rank + 1; ++i) d.weight();
  return d.take();
}

}  // namespace

RankActions dualpipev(const Sizes& sizes) {
  require_stages_per_rank("dualpipev", sizes, 2, "V placement");
  if (sizes.microbatches < 2 * sizes.pp) {
    refuse(
        "dualpipev",
        "at least as many microbatches as stages (2 * pp = " + std::to_string(2 * sizes.pp) + ")",
        std::to_string(sizes.microbatches));
  }
  RankActions ranks;
  for (int32_t rank = 0; rank < sizes.pp; ++rank) ranks.push_back(dualpipev_rank(sizes, rank));
  return ranks;
}

}  // namespace meshrun::schedules
