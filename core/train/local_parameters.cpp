#include "train/local_parameters.hpp"

#include <algorithm>
#include <cmath>

#include "train/hooks.hpp"

namespace meshrun::train {

FlatParameters::FlatParameters(const ModelDescription& description, std::vector<int64_t> held)
    : indices(std::move(held)), offsets{0}, position(description.parameters.size(), -1) {
  for (size_t k = 0; k < indices.size(); ++k) {
    position[size_t(indices[k])] = int64_t(k);
    offsets.push_back(offsets.back() + description.parameters[size_t(indices[k])].numel);
  }
  values.assign(size_t(numel()), 0.0f);
  gradients.assign(size_t(numel()), 0.0f);
}

StrategyBuffers FlatParameters::strategy_buffers(const ModelDescription& description) {
  StrategyBuffers buffers{values.data(), gradients.data(), numel(), offsets, {}};
  for (const int64_t p : indices)
    buffers.parameter_names.push_back(description.parameters[size_t(p)].name);
  return buffers;
}

void FlatParameters::release() {
  std::vector<float>().swap(values);
  std::vector<float>().swap(gradients);
}

void start_weights(const Config& config, const Model& model, FlatParameters& parameters) {
  const ModelDescription& d = model.description();
  std::vector<float> full;
  if (!config.model.checkpoint.empty()) {
    full.resize(size_t(d.numel));
    read_consolidated(config, d, full.data());
  }
  for (size_t k = 0; k < parameters.indices.size(); ++k) {
    float* values = parameters.values.data() + parameters.offsets[k];
    const ModelParameter& parameter = d.parameters[size_t(parameters.indices[k])];
    if (full.empty()) {
      model.init_parameter(uint64_t(config.train.seed), parameters.indices[k], values);
    } else {
      std::copy_n(full.begin() + parameter.offset, parameter.numel, values);
    }
  }
  round_to(parameters.values.data(), parameters.numel(), config.model.torch_dtype);
}

LocalParameters replicated_parameters(float* values, float* gradients,
                                      const std::vector<int64_t>& offsets, Communicator& world) {
  LocalParameters local;
  local.params = values;
  local.grads = gradients;
  local.numel = offsets.back();
  for (size_t k = 0; k + 1 < offsets.size(); ++k) {
    local.held.push_back({offsets[k], offsets[k], offsets[k + 1] - offsets[k]});
    local.held_parameter.push_back(int64_t(k));
  }
  const int64_t begin = world.rank() * local.numel / world.size();
  const int64_t end = (world.rank() + 1) * local.numel / world.size();
  local.saved.push_back({begin, begin, end - begin});
  return local;
}

LocalParameters sharded_parameters(Strategy& strategy, Communicator& shard_group,
                                   Communicator& replicate_group) {
  LocalParameters local;
  const auto [params, grads] = strategy.local_shard();
  local.params = params.data;
  local.grads = grads.data;
  local.numel = params.numel;
  for (const meshrun_shard_segment& segment : strategy.shard_segments()) {
    local.held.push_back({segment.global_begin, segment.local_begin, segment.count});
    local.held_parameter.push_back(segment.parameter);
  }
  if (replicate_group.rank() == 0) local.saved = local.held;
  local.norm_group = &shard_group;
  return local;
}

std::vector<uint8_t> decay_mask(const LocalParameters& local, const ModelDescription& description,
                                const std::vector<int64_t>& parameters) {
  std::vector<uint8_t> mask(size_t(local.numel), 0);
  for (size_t k = 0; k < local.held.size(); ++k) {
    const auto& parameter =
        description.parameters[size_t(parameters[size_t(local.held_parameter[k])])];
    const HeldRange& range = local.held[k];
    std::fill_n(mask.begin() + range.local_begin, range.count, uint8_t(parameter.shape.size() > 1));
  }
  return mask;
}

std::optional<int64_t> first_nonfinite_gradient(const LocalParameters& local,
                                                const std::vector<int64_t>& parameters) {
  std::optional<int64_t> first;
  for (size_t k = 0; k < local.held.size(); ++k) {
    const float* begin = local.grads + local.held[k].local_begin;
    const bool finite =
        std::all_of(begin, begin + local.held[k].count, [](float g) { return std::isfinite(g); });
    const int64_t index = parameters[size_t(local.held_parameter[k])];
    if (!finite && (!first || index < *first)) first = index;
  }
  return first;
}

}  // namespace meshrun::train
