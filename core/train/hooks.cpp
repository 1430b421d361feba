#include "train/hooks.hpp"

#include <algorithm>
#include <string>

namespace meshrun::train {
namespace {

// "model.layers.N...." belongs to layer N; everything else to the root.
int unit_of(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) != 0) return llama::kRootUnit;
  return std::stoi(name.substr(prefix.size()));
}

}  // namespace

std::vector<std::vector<ElementRange>> unit_ranges(const llama::LlamaModel& model) {
  std::vector<std::vector<ElementRange>> ranges(model.config().num_hidden_layers + 1);
  int64_t offset = 0;
  for (const auto& view : model.parameters()) {
    auto& unit = ranges[unit_of(view.name) + 1];
    if (!unit.empty() && unit.back().second == offset) {
      unit.back().second += view.numel;
    } else {
      unit.push_back({offset, offset + view.numel});
    }
    offset += view.numel;
  }
  for (auto& unit : ranges) std::reverse(unit.begin(), unit.end());
  return ranges;
}

}  // namespace meshrun::train
