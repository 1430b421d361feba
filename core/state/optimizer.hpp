// AdamW with PyTorch's formula (torch.optim.AdamW: decoupled weight decay,
// bias-corrected moments), its learning-rate schedule, and gradient-norm
// clipping, over the model's flat parameter buffer.
#pragma once

#include <cstdint>
#include <vector>

#include "config/config.hpp"

namespace meshrun {

// Linear warmup over train.warmup_steps (step s of 0..steps-1 gets
// lr * (s + 1) / warmup_steps), then cosine decay to train.min_lr at the
// last step.
double learning_rate(const TrainConfig& train, int64_t step);

// The L2 norm of `count` gradients. Replicated strategies (DDP) hold the
// whole averaged gradient on every rank, so this local norm is the global
// one; a sharded strategy would all-reduce the squared norms of its shards
// (sum) before the square root.
double squared_norm(const float* values, int64_t count);

// torch.nn.utils.clip_grad_norm_: scales the gradients by
// max_norm / (norm + 1e-6) when norm exceeds max_norm (0 disables clipping).
void clip_gradients(float* gradients, int64_t count, double norm, double max_norm);

class AdamW {
 public:
  // `decay[i]` says whether element i gets weight decay (the trainer exempts
  // the 1-D norm weights, as GPT-style trainers do).
  AdamW(const TrainConfig& train, std::vector<uint8_t> decay);

  // One update with learning rate `lr`; counts the step for bias correction.
  void step(float* parameters, const float* gradients, double lr);

  int64_t steps_taken() const { return steps_taken_; }
  // The moments, for sharded checkpoints; restore with restore().
  std::vector<float>& exp_avg() { return exp_avg_; }
  std::vector<float>& exp_avg_sq() { return exp_avg_sq_; }
  void restore(int64_t steps_taken) { steps_taken_ = steps_taken; }
  int64_t state_bytes() const { return int64_t((exp_avg_.size() + exp_avg_sq_.size()) * 4); }

 private:
  double beta1_, beta2_, eps_, weight_decay_;
  std::vector<uint8_t> decay_;
  std::vector<float> exp_avg_;
  std::vector<float> exp_avg_sq_;
  int64_t steps_taken_ = 0;
};

}  // namespace meshrun
