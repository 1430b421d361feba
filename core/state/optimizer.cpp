#include "state/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "state/adamw_update.hpp"

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

void clip_gradients(StateDevice& device, float* gradients, int64_t count, double norm,
                    double max_norm) {
  if (max_norm <= 0.0 || norm <= max_norm) return;
  device.scale(gradients, count, float(max_norm / (norm + 1e-6)));
}

void adamw_update_all(float* parameters, float* exp_avg, float* exp_avg_sq, const float* gradients,
                      const uint8_t* decay, int64_t count, const AdamWConstants& constants) {
  for (int64_t i = 0; i < count; ++i) {
    adamw_update(parameters[i], exp_avg[i], exp_avg_sq[i], gradients[i], decay[i] != 0, constants);
  }
}

AdamW::AdamW(const TrainConfig& train, const std::vector<uint8_t>& decay, StateDevice& device)
    : device_(device),
      beta1_(train.beta1),
      beta2_(train.beta2),
      eps_(train.eps),
      weight_decay_(train.weight_decay),
      decay_(int64_t(decay.size()), device),
      exp_avg_(int64_t(decay.size()), device),
      exp_avg_sq_(int64_t(decay.size()), device) {
  device.copy_from_host(decay_.data(), decay.data(), int64_t(decay.size()));
}

void AdamW::step(float* parameters, const float* gradients, double lr) {
  ++steps_taken_;
  const AdamWConstants constants =
      adamw_constants(lr, beta1_, beta2_, eps_, weight_decay_, steps_taken_);
  device_.adamw(parameters, exp_avg_.data(), exp_avg_sq_.data(), gradients, decay_.data(), numel(),
                constants);
}

}  // namespace meshrun
