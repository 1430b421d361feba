// The trainer's side of the module hooks: as soon as backward has made a
// parameter's gradient final (the model's gradient_ready hook, last
// parameter first), the strategy is told its element range, so DDP starts
// reducing a bucket the moment its last gradient is done, while backward
// goes on.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "llama/model.hpp"
#include "strategy/strategy.hpp"

namespace meshrun::train {

using ElementRange = std::pair<int64_t, int64_t>;  // [begin, end) of the flat buffers

// Each parameter's range in the flat buffers, in parameters() order.
std::vector<ElementRange> parameter_ranges(const llama::LlamaModel& model);

class StrategyHooks : public llama::ModuleHooks {
 public:
  StrategyHooks(Strategy& strategy, const llama::LlamaModel& model)
      : strategy_(strategy), ranges_(parameter_ranges(model)) {}

  void gradient_ready(int parameter) override {
    const auto& [begin, end] = ranges_[static_cast<size_t>(parameter)];
    strategy_.gradients_ready(begin, end);
  }

 private:
  Strategy& strategy_;
  std::vector<ElementRange> ranges_;
};

}  // namespace meshrun::train
