// The parameters a rank's optimizer updates: the model's whole buffers under
// a replicated strategy (ddp), or this rank's shard under a sharded one
// (fsdp2, ABI 1.3), together with what clipping, weight decay and sharded
// checkpoints need to know about them.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/comm.hpp"
#include "llama/model.hpp"
#include "strategy/strategy.hpp"
#include "train/checkpoint.hpp"

namespace meshrun::train {

struct LocalParameters {
  float* params = nullptr;
  float* grads = nullptr;
  int64_t numel = 0;
  // The parameter elements in the local buffers, and the parameter index of
  // each range; elements in no range are padding (zero).
  std::vector<HeldRange> held;
  std::vector<int64_t> held_parameter;
  // What this rank writes into a sharded checkpoint.
  std::vector<HeldRange> saved;
  // Where squared gradient norms are summed; null when the local gradients
  // are all of them (replicated).
  Communicator* norm_group = nullptr;
};

// The model's buffers; rank r of `world` saves its 1/W of them.
LocalParameters replicated_parameters(llama::LlamaModel& model, Communicator& world);

// The strategy's local shard; the norm is summed over `shard_group`, and
// only replica 0 of each shard saves it (the replicas hold equal shards).
LocalParameters sharded_parameters(Strategy& strategy, Communicator& shard_group,
                                   Communicator& replicate_group);

// 1 for the elements that get weight decay: every matrix, none of the 1-D
// norm weights (GPT-2 / nanoGPT practice: decaying a norm's scale towards 0
// only hurts), and no padding.
std::vector<uint8_t> decay_mask(const LocalParameters& local,
                                const std::vector<llama::ParameterView>& parameters);

}  // namespace meshrun::train
