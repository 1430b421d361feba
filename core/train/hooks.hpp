// The trainer's side of the module hooks: when the model's backward has
// finished a unit (a decoder layer, or the root with embed_tokens, norm and
// lm_head), the strategy is told which gradient ranges are final, so DDP can
// start reducing them while backward goes on.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "llama/model.hpp"
#include "strategy/strategy.hpp"

namespace meshrun::train {

using ElementRange = std::pair<int64_t, int64_t>;  // [begin, end) of the flat buffers

// Each unit's parameter ranges (index unit + 1, so the root is index 0),
// contiguous parameters merged, highest offsets first: the order in which
// backward finishes them.
std::vector<std::vector<ElementRange>> unit_ranges(const llama::LlamaModel& model);

class StrategyHooks : public llama::ModuleHooks {
 public:
  StrategyHooks(Strategy& strategy, const llama::LlamaModel& model)
      : strategy_(strategy), ranges_(unit_ranges(model)) {}

  void post_backward(int unit) override {
    for (const auto& [begin, end] : ranges_[unit + 1]) strategy_.gradients_ready(begin, end);
  }

 private:
  Strategy& strategy_;
  std::vector<std::vector<ElementRange>> ranges_;
};

}  // namespace meshrun::train
