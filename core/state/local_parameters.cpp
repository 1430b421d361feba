#include "state/local_parameters.hpp"

#include <algorithm>
#include <cmath>

#include "meshrun/dtype.hpp"
#include "state/optimizer.hpp"

namespace meshrun {

void round_to(float* values, int64_t count, const std::string& dtype) {
  if (dtype == "bfloat16") {
    for (int64_t i = 0; i < count; ++i) values[i] = rounded_to_bfloat16(values[i]);
  } else if (dtype == "float16") {
    for (int64_t i = 0; i < count; ++i) values[i] = float16_to_float(float_to_float16(values[i]));
  }
}

FlatParameters::FlatParameters(const ModelDescription& description, std::vector<int64_t> held,
                               StateDevice& device, bool allocate)
    : indices(std::move(held)),
      offsets{0},
      device(&device),
      position(description.parameters.size(), -1) {
  for (size_t k = 0; k < indices.size(); ++k) {
    position[size_t(indices[k])] = int64_t(k);
    offsets.push_back(offsets.back() + description.parameters[size_t(indices[k])].numel);
  }
  if (!allocate) return;
  values = StateArray<float>(numel(), device);
  gradients = StateArray<float>(numel(), device);
}

StrategyBuffers FlatParameters::strategy_buffers(const ModelDescription& description) {
  StrategyBuffers buffers{values.data(), gradients.data(), numel(), offsets, {}};
  buffers.device = device->where();
  buffers.compute_stream = device->stream();
  for (const int64_t p : indices)
    buffers.parameter_names.push_back(description.parameters[size_t(p)].name);
  return buffers;
}

void FlatParameters::release() {
  values = StateArray<float>();
  gradients = StateArray<float>();
}

namespace {

// The starting values of one parameter at a time, this tp rank's piece:
// initialized from train.seed, or read from model.checkpoint.
class StartingValues {
 public:
  StartingValues(const Config& config, const Model& model, const TensorParallelRank& tp)
      : model_(model), tp_(tp), seed_(uint64_t(config.train.seed)) {
    if (!config.model.checkpoint.empty()) checkpoint_.emplace(config, model.description());
  }

  // Writes parameter p's piece (in the tp-local layout) to `piece`.
  void piece(int64_t p, float* piece) {
    const ModelParameter& parameter = model_.description().parameters[size_t(p)];
    full_.resize(size_t(parameter.numel));
    if (checkpoint_) {
      checkpoint_->read(parameter, full_.data());
    } else {
      model_.init_parameter(seed_, p, full_.data());
    }
    tp_.layout.slice(p, tp_.group.rank(), full_.data(), piece);
  }

 private:
  const Model& model_;
  const TensorParallelRank& tp_;
  uint64_t seed_;
  std::optional<ConsolidatedWeights> checkpoint_;
  std::vector<float> full_;
};

}  // namespace

void start_weights(const Config& config, const Model& model, const TensorParallelRank& tp,
                   FlatParameters& parameters) {
  StartingValues start(config, model, tp);
  std::vector<float> piece;
  for (size_t k = 0; k < parameters.indices.size(); ++k) {
    const int64_t count = parameters.offsets[k + 1] - parameters.offsets[k];
    piece.resize(size_t(count));
    start.piece(parameters.indices[k], piece.data());
    round_to(piece.data(), count, config.model.torch_dtype);
    parameters.device->copy_from_host(parameters.values.data() + parameters.offsets[k],
                                      piece.data(), count * int64_t(sizeof(float)));
  }
}

void start_shard_weights(const Config& config, const Model& model, const TensorParallelRank& tp,
                         const FlatParameters& parameters, Strategy& strategy) {
  StartingValues start(config, model, tp);
  const FloatView shard = strategy.local_shard().first;
  HostView values(*parameters.device, shard.data, shard.numel);
  std::vector<float> piece;
  int64_t started = -1;  // the strategy parameter `piece` holds
  for (const meshrun_shard_segment& segment : strategy.shard_segments()) {
    const auto k = size_t(segment.parameter);
    if (segment.parameter != started) {
      piece.resize(size_t(parameters.offsets[k + 1] - parameters.offsets[k]));
      start.piece(parameters.indices[k], piece.data());
      started = segment.parameter;
    }
    std::copy_n(piece.begin() + (segment.global_begin - parameters.offsets[k]), segment.count,
                values.data() + segment.local_begin);
  }
  round_to(values.data(), shard.numel, config.model.torch_dtype);
  values.write_back();
}

namespace {

// Appends `range`, or extends the last range when it continues it in both
// layouts: without tensor parallelism a rank's ranges stay as few as its
// strategy made them.
void append_merged(std::vector<HeldRange>& ranges, const HeldRange& range) {
  if (!ranges.empty()) {
    HeldRange& last = ranges.back();
    if (last.global_begin + last.count == range.global_begin &&
        last.local_begin + last.count == range.local_begin) {
      last.count += range.count;
      return;
    }
  }
  ranges.push_back(range);
}

}  // namespace

std::vector<HeldRange> model_ranges(const std::vector<HeldRange>& ranges,
                                    const FlatParameters& parameters, const TensorParallelRank& tp,
                                    bool saving, int64_t local_base) {
  std::vector<HeldRange> out;
  const std::vector<int64_t>& offsets = parameters.offsets;
  for (const HeldRange& range : ranges) {
    const int64_t end = range.global_begin + range.count;
    auto k = size_t(std::upper_bound(offsets.begin(), offsets.end(), range.global_begin) -
                    offsets.begin() - 1);
    for (int64_t at = range.global_begin; at < end; at = offsets[++k]) {
      const int64_t p = parameters.indices[k];
      const int64_t count = std::min(end, offsets[k + 1]) - at;
      if (saving && tp.group.rank() != 0 && !tp.layout.placement(p).sharded()) continue;
      const int64_t local = local_base + range.local_begin + (at - range.global_begin);
      tp.layout.for_each_run(
          p, tp.group.rank(), at - offsets[k], count, [&](int64_t l, int64_t f, int64_t n) {
            append_merged(out, {tp.layout.full_offset(p) + f, local + l - (at - offsets[k]), n});
          });
    }
  }
  return out;
}

void gather_tensor_parallel(const FlatParameters& parameters, const float* local_values,
                            const TensorParallelRank& tp, float* full) {
  const int64_t ranks = tp.group.size(), numel = parameters.numel();
  std::vector<float> all(size_t(ranks * numel)), pieces;
  FlatTensor send(const_cast<float*>(local_values), dtype_float32(), numel);
  FlatTensor receive(all.data(), dtype_float32(), ranks * numel);
  tp.group.all_gather(send.get(), receive.get()).wait();
  for (size_t k = 0; k < parameters.indices.size(); ++k) {
    const int64_t p = parameters.indices[k], begin = parameters.offsets[k];
    const int64_t count = parameters.offsets[k + 1] - begin;
    pieces.resize(size_t(ranks * count));
    for (int64_t r = 0; r < ranks; ++r) {
      std::copy_n(all.begin() + r * numel + begin, count, pieces.begin() + r * count);
    }
    tp.layout.assemble(p, pieces.data(), full + tp.layout.full_offset(p));
  }
}

double tensor_parallel_squared_norm(StateDevice& device, const LocalParameters& local,
                                    const std::vector<int64_t>& parameters,
                                    const TensorParallelRank& tp) {
  if (tp.group.size() == 1) return device.squared_norm(local.grads, local.numel);
  double squared = 0;
  for (size_t k = 0; k < local.held.size(); ++k) {
    const int64_t p = parameters[size_t(local.held_parameter[k])];
    if (tp.group.rank() == 0 || tp.layout.placement(p).sharded()) {
      squared += device.squared_norm(local.grads + local.held[k].local_begin, local.held[k].count);
    }
  }
  return squared;
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

std::optional<int64_t> first_nonfinite_gradient(StateDevice& device, const LocalParameters& local,
                                                const std::vector<int64_t>& parameters) {
  // One check of the whole buffer first: on a GPU each check waits for it.
  if (device.all_finite(local.grads, local.numel)) return std::nullopt;
  std::optional<int64_t> first;
  for (size_t k = 0; k < local.held.size(); ++k) {
    const bool finite =
        device.all_finite(local.grads + local.held[k].local_begin, local.held[k].count);
    const int64_t index = parameters[size_t(local.held_parameter[k])];
    if (!finite && (!first || index < *first)) first = index;
  }
  return first;
}

std::vector<std::vector<float>> concatenated_state(const std::vector<ShardState>& shards) {
  int64_t total = 0;
  for (const ShardState& shard : shards) total += shard.local->numel;
  std::vector<std::vector<float>> state(3, std::vector<float>(size_t(total)));
  int64_t base = 0;
  for (const ShardState& shard : shards) {
    const int64_t bytes = shard.local->numel * int64_t(sizeof(float));
    AdamW& optimizer = *shard.optimizer;
    optimizer.device().copy_to_host(state[0].data() + base, shard.local->params, bytes);
    optimizer.device().copy_to_host(state[1].data() + base, optimizer.exp_avg(), bytes);
    optimizer.device().copy_to_host(state[2].data() + base, optimizer.exp_avg_sq(), bytes);
    base += shard.local->numel;
  }
  return state;
}

void scatter_state(const std::vector<std::vector<float>>& state,
                   const std::vector<ShardState>& shards) {
  int64_t base = 0;
  for (const ShardState& shard : shards) {
    const int64_t bytes = shard.local->numel * int64_t(sizeof(float));
    AdamW& optimizer = *shard.optimizer;
    optimizer.device().copy_from_host(shard.local->params, state[0].data() + base, bytes);
    optimizer.device().copy_from_host(optimizer.exp_avg(), state[1].data() + base, bytes);
    optimizer.device().copy_from_host(optimizer.exp_avg_sq(), state[2].data() + base, bytes);
    base += shard.local->numel;
  }
}

}  // namespace meshrun
