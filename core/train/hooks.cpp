#include "train/hooks.hpp"

namespace meshrun::train {

std::vector<ElementRange> parameter_ranges(const llama::LlamaModel& model) {
  std::vector<ElementRange> ranges;
  int64_t offset = 0;
  for (const auto& view : model.parameters()) {
    ranges.push_back({offset, offset + view.numel});
    offset += view.numel;
  }
  return ranges;
}

}  // namespace meshrun::train
