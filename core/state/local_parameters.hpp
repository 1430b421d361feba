// The parameters a rank's optimizer updates: the model's whole buffers under
// a replicated strategy (ddp), or this rank's shard under a sharded one
// (fsdp2, ABI 1.3), together with what clipping, weight decay and sharded
// checkpoints need to know about them.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "comm/comm.hpp"
#include "model/model.hpp"
#include "model/tensor_parallel.hpp"
#include "state/checkpoint.hpp"
#include "state/optimizer.hpp"
#include "state/state_device.hpp"
#include "strategy/strategy.hpp"

namespace meshrun {

// Some parameters of a model (description indices, ascending) and their
// gradients in two flat buffers of a state device's memory, in that order:
// a replicated strategy's storage, and the weights a sharded one takes its
// shard from.
struct FlatParameters {
  // Without `allocate` both buffers stay empty: a strategy that takes
  // weights by shard starts without them. `device` must outlive them.
  FlatParameters(const ModelDescription& description, std::vector<int64_t> indices,
                 StateDevice& device, bool allocate = true);

  std::vector<int64_t> indices;
  std::vector<int64_t> offsets;  // indices.size() + 1 element offsets
  StateDevice* device;
  StateArray<float> values, gradients;
  // Position of description parameter p in `indices`, or -1.
  std::vector<int64_t> position;

  int64_t numel() const { return offsets.back(); }
  // What a strategy's setup needs to know about them (their device, and
  // its stream as the compute stream; the comm stream is the caller's to
  // set); null buffers when they were not allocated.
  StrategyBuffers strategy_buffers(const ModelDescription& description);
  // Frees both buffers: a sharded strategy holds the parameters now.
  void release();
};

// This rank's place in tensor parallelism: how the plan places the
// parameters over tp, and the tp group (size 1 without tensor parallelism).
struct TensorParallelRank {
  const TensorParallelLayout& layout;
  Communicator& group;
};

// Rounds float32 values to `dtype` ("float32" leaves them), kept as float32:
// what a 16-bit compute or storage dtype does to the values it holds.
void round_to(float* values, int64_t count, const std::string& dtype);

// The starting weights of the parameters, this tp rank's pieces of them:
// initialized from train.seed, or read from model.checkpoint, then rounded
// to model.torch_dtype, one parameter at a time on the host and copied to
// the parameters' device. `parameters` is in the tp-local layout.
void start_weights(const Config& config, const Model& model, const TensorParallelRank& tp,
                   FlatParameters& parameters);
// The same weights written into `strategy`'s local shard (set up without
// weights, its parameters `parameters`, its memory `parameters.device`'s),
// one parameter at a time: a rank holds at most one whole parameter
// besides its shard (and, on a GPU, a host copy of the shard).
void start_shard_weights(const Config& config, const Model& model, const TensorParallelRank& tp,
                         const FlatParameters& parameters, Strategy& strategy);

struct LocalParameters {
  float* params = nullptr;
  float* grads = nullptr;
  int64_t numel = 0;
  // The parameter elements in the local buffers, and the parameter of each
  // range (an index into the strategy's parameters); elements in no range
  // are padding (zero).
  std::vector<HeldRange> held;
  std::vector<int64_t> held_parameter;
  // What this rank writes into a sharded checkpoint.
  std::vector<HeldRange> saved;
  // Where squared gradient norms are summed; null when the local gradients
  // are all of them (replicated).
  Communicator* norm_group = nullptr;
};

// Flat buffers of every parameter (parameter i at [offsets[i],
// offsets[i+1])) that a replicated strategy works in; rank r of `world`
// saves its 1/W of them.
LocalParameters replicated_parameters(float* values, float* gradients,
                                      const std::vector<int64_t>& offsets, Communicator& world);

// The strategy's local shard; the norm is summed over `shard_group`, and
// only replica 0 of each shard saves it (the replicas hold equal shards).
LocalParameters sharded_parameters(Strategy& strategy, Communicator& shard_group,
                                   Communicator& replicate_group);

// `ranges` of `parameters`' tp-local flat layout (as local buffers hold
// them, shifted by `local_base`) as ranges of the full model's flat layout
// (checkpoints are of the full model, whatever the layout). With `saving`,
// parameters that tp replicates are left to tp rank 0, so that the ranks
// together name every element once.
std::vector<HeldRange> model_ranges(const std::vector<HeldRange>& ranges,
                                    const FlatParameters& parameters, const TensorParallelRank& tp,
                                    bool saving, int64_t local_base = 0);

// The full values of `parameters` from `local_values` (tp-local flat layout,
// parameters.numel()) into `full` (the full model's flat layout).
// Collective over the tp group.
void gather_tensor_parallel(const FlatParameters& parameters, const float* local_values,
                            const TensorParallelRank& tp, float* full);

// This rank's share of the squared gradient norm over the tp group (the
// gradients in `device`'s memory): the
// squares of the pieces of tp-sharded parameters, and the tp-replicated
// ones (equal on every tp rank) on tp rank 0 only.
double tensor_parallel_squared_norm(StateDevice& device, const LocalParameters& local,
                                    const std::vector<int64_t>& parameters,
                                    const TensorParallelRank& tp);

// 1 for the elements that get weight decay: every matrix, none of the 1-D
// norm weights and biases (GPT-2 / nanoGPT practice: decaying a norm's scale
// towards 0 only hurts), and no padding. `parameters` maps the strategy's
// parameter indices to the description's.
std::vector<uint8_t> decay_mask(const LocalParameters& local, const ModelDescription& description,
                                const std::vector<int64_t>& parameters);

// The description index of the first parameter (in the description's
// order) with a gradient element in `local` that is not finite; nullopt
// when every one is finite. `parameters` maps the strategy's parameter
// indices to the description's; the gradients are `device`'s memory.
std::optional<int64_t> first_nonfinite_gradient(StateDevice& device, const LocalParameters& local,
                                                const std::vector<int64_t>& parameters);

// A local shard and its optimizer: one of several a rank updates (a
// pipeline rank's stages, a mixture of experts' dense and expert
// parameters), whose states one sharded checkpoint holds concatenated.
struct ShardState {
  LocalParameters* local;
  AdamW* optimizer;
};
// params, exp_avg and exp_avg_sq of the shards, each concatenated in order,
// copied to the host from the memory of each shard's optimizer's device
// (where its parameters are too).
std::vector<std::vector<float>> concatenated_state(const std::vector<ShardState>& shards);
// Back into the shards.
void scatter_state(const std::vector<std::vector<float>>& state,
                   const std::vector<ShardState>& shards);

}  // namespace meshrun
