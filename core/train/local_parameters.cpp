#include "train/local_parameters.hpp"

namespace meshrun::train {

LocalParameters replicated_parameters(llama::LlamaModel& model, Communicator& world) {
  LocalParameters local;
  local.params = model.param_buffer();
  local.grads = model.grad_buffer();
  local.numel = model.num_parameters();
  int64_t offset = 0;
  for (size_t p = 0; p < model.parameters().size(); ++p) {
    const int64_t numel = model.parameters()[p].numel;
    local.held.push_back({offset, offset, numel});
    local.held_parameter.push_back(int64_t(p));
    offset += numel;
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

std::vector<uint8_t> decay_mask(const LocalParameters& local,
                                const std::vector<llama::ParameterView>& parameters) {
  std::vector<uint8_t> mask(size_t(local.numel), 0);
  for (size_t k = 0; k < local.held.size(); ++k) {
    const auto& view = parameters[size_t(local.held_parameter[k])];
    const HeldRange& range = local.held[k];
    std::fill_n(mask.begin() + range.local_begin, range.count, uint8_t(view.shape.size() > 1));
  }
  return mask;
}

}  // namespace meshrun::train
