#include "state/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace meshrun {

double learning_rate(const TrainConfig& train, int64_t step) {
  if (step < train.warmup_steps) return train.lr * double(step + 1) / double(train.warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, train.steps - 1 - train.warmup_steps);
  const double progress = std::min(1.0, double(step - train.warmup_steps) / double(decay_steps));
  return train.min_lr +
         0.5 * (train.lr - train.min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

double squared_norm(const float* values, int64_t count) {
  // Eight running sums, so the loop vectorizes without reordering a sum
  // behind the compiler's back: the result is the same on every build.
  constexpr int64_t kLanes = 8;
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += double(values[i + l]) * double(values[i + l]);
  }
  for (; i < count; ++i) lanes[0] += double(values[i]) * double(values[i]);
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  return sum;
}

void clip_gradients(float* gradients, int64_t count, double norm, double max_norm) {
  if (max_norm <= 0.0 || norm <= max_norm) return;
  const auto scale = float(max_norm / (norm + 1e-6));
  for (int64_t i = 0; i < count; ++i) gradients[i] *= scale;
}

AdamW::AdamW(const TrainConfig& train, std::vector<uint8_t> decay)
    : beta1_(train.beta1),
      beta2_(train.beta2),
      eps_(train.eps),
      weight_decay_(train.weight_decay),
      decay_(std::move(decay)),
      exp_avg_(decay_.size(), 0.0f),
      exp_avg_sq_(decay_.size(), 0.0f) {}

void AdamW::step(float* parameters, const float* gradients, double lr) {
  ++steps_taken_;
  const double correction1 = 1.0 - std::pow(beta1_, double(steps_taken_));
  const double correction2 = 1.0 - std::pow(beta2_, double(steps_taken_));
  const auto step_size = float(lr / correction1);
  const auto inv_sqrt_correction2 = float(1.0 / std::sqrt(correction2));
  const auto decay_factor = float(1.0 - lr * weight_decay_);
  const auto b1 = float(beta1_), b2 = float(beta2_), eps = float(eps_);
  const auto n = int64_t(decay_.size());
  for (int64_t i = 0; i < n; ++i) {
    const float g = gradients[i];
    parameters[i] *= decay_[i] ? decay_factor : 1.0f;
    exp_avg_[i] = b1 * exp_avg_[i] + (1.0f - b1) * g;
    exp_avg_sq_[i] = b2 * exp_avg_sq_[i] + (1.0f - b2) * g * g;
    const float denom = std::sqrt(exp_avg_sq_[i]) * inv_sqrt_correction2 + eps;
    parameters[i] -= step_size * exp_avg_[i] / denom;
  }
}

}  // namespace meshrun
