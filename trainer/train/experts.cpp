#include "train/experts.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <vector>

namespace meshrun::train {

std::pair<StageContents, StageContents> split_experts(const ModelDescription& description,
                                                      const StageContents& contents) {
  StageContents dense, experts;
  for (const int64_t p : contents.parameters) {
    const ModelParameter& parameter = description.parameters[size_t(p)];
    StageContents& part = parameter.expert >= 0 ? experts : dense;
    part.parameters.push_back(p);
    if (part.units.empty() || part.units.back() != parameter.unit) {
      part.units.push_back(parameter.unit);
    }
  }
  std::sort(dense.units.begin(), dense.units.end());
  dense.units.erase(std::unique(dense.units.begin(), dense.units.end()), dense.units.end());
  return {dense, experts};
}

std::string expert_options(const Config& config, const std::string& options) {
  auto json = nlohmann::json::parse(options);
  json["dp_replicate_size"] = 1;
  json["reshard_after_forward"] = config.distributed.moe.reshard_after_forward;
  return json.dump();
}

std::optional<ExpertMetrics> gather_expert_metrics(const std::optional<RouterStatistics>& local,
                                                   const ModelDescription& description,
                                                   double micro_batches, const CommTraffic& traffic,
                                                   Communicator& over) {
  if (!description.experts) return std::nullopt;
  const int64_t experts = description.experts->count;
  std::vector<float> sums(size_t(experts) + 1, 0.0f);
  if (local) {
    sums[0] = float(local->aux_loss);
    for (size_t e = 0; e < local->expert_tokens.size() && e < size_t(experts); ++e) {
      sums[e + 1] = float(local->expert_tokens[e]);
    }
  }
  FlatTensor tensor(sums.data(), dtype_float32(), int64_t(sums.size()));
  over.all_reduce(tensor.get(), ReduceOp::sum).wait();
  ExpertMetrics metrics;
  metrics.aux_loss = double(sums[0]) / micro_batches;
  for (int64_t e = 0; e < experts; ++e) {
    metrics.expert_tokens.push_back(int64_t(sums[size_t(e) + 1]));
  }
  metrics.ep_bytes = traffic.bytes;
  metrics.ep_wait_s = traffic.wait_seconds;
  return metrics;
}

}  // namespace meshrun::train
