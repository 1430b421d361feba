// AdamW with PyTorch's formula (torch.optim.AdamW: decoupled weight decay,
// bias-corrected moments), its learning-rate schedule, and gradient-norm
// clipping, over the model's flat parameter buffer.
#pragma once

#include <cstdint>
#include <vector>

#include "config/config.hpp"
#include "state/adamw_update.hpp"
#include "state/state_device.hpp"

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

// torch.nn.utils.clip_grad_norm_: scales the gradients (memory of
// `device`) by max_norm / (norm + 1e-6) when norm exceeds max_norm (0
// disables clipping).
void clip_gradients(StateDevice& device, float* gradients, int64_t count, double norm,
                    double max_norm);

// One AdamW update of `count` host elements, the host state device's loop.
void adamw_update_all(float* parameters, float* exp_avg, float* exp_avg_sq, const float* gradients,
                      const uint8_t* decay, int64_t count, const AdamWConstants& constants);

class AdamW {
 public:
  // `decay[i]` says whether element i gets weight decay (the trainer exempts
  // the 1-D norm weights, as GPT-style trainers do). The moments and the
  // mask live in `device`'s memory (which must outlive the optimizer).
  AdamW(const TrainConfig& train, const std::vector<uint8_t>& decay,
        StateDevice& device = host_state_device());

  // One update with learning rate `lr` of parameters and gradients in the
  // device's memory; counts the step for bias correction.
  void step(float* parameters, const float* gradients, double lr);

  int64_t steps_taken() const { return steps_taken_; }
  // The moments (the device's memory, numel() each), for sharded
  // checkpoints; restore with restore().
  float* exp_avg() { return exp_avg_.data(); }
  float* exp_avg_sq() { return exp_avg_sq_.data(); }
  int64_t numel() const { return exp_avg_.size(); }
  StateDevice& device() const { return device_; }
  void restore(int64_t steps_taken) { steps_taken_ = steps_taken; }
  int64_t state_bytes() const { return 2 * numel() * int64_t(sizeof(float)); }

 private:
  StateDevice& device_;
  double beta1_, beta2_, eps_, weight_decay_;
  StateArray<uint8_t> decay_;
  StateArray<float> exp_avg_;
  StateArray<float> exp_avg_sq_;
  int64_t steps_taken_ = 0;
};

}  // namespace meshrun
