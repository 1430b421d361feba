// One AdamW update of one element (torch.optim.AdamW's formula: decoupled
// weight decay, bias-corrected moments) and the constants of a step, in one
// place for the CPU optimizer (state/optimizer.hpp) and its CUDA twin
// (trainer/cuda/adamw.hpp): a header both compilers read, plain C++17.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MESHRUN_HOST_DEVICE __host__ __device__
#else
#define MESHRUN_HOST_DEVICE
#endif

namespace meshrun {

// What step `step` (1-based) with learning rate `lr` multiplies by.
struct AdamWConstants {
  float step_size = 0;             // lr / (1 - beta1^step)
  float inv_sqrt_correction2 = 0;  // 1 / sqrt(1 - beta2^step)
  float decay_factor = 1;          // 1 - lr weight_decay
  float beta1 = 0, beta2 = 0, eps = 0;
};

inline AdamWConstants adamw_constants(double lr, double beta1, double beta2, double eps,
                                      double weight_decay, int64_t step) {
  AdamWConstants c;
  c.step_size = float(lr / (1.0 - std::pow(beta1, double(step))));
  c.inv_sqrt_correction2 = float(1.0 / std::sqrt(1.0 - std::pow(beta2, double(step))));
  c.decay_factor = float(1.0 - lr * weight_decay);
  c.beta1 = float(beta1);
  c.beta2 = float(beta2);
  c.eps = float(eps);
  return c;
}

//   p *= decay_factor (where decayed);  m = b1 m + (1 - b1) g;
//   v = b2 v + (1 - b2) g^2;  p -= step_size m / (sqrt(v) / sqrt(1 - b2^t) + eps)
MESHRUN_HOST_DEVICE inline void adamw_update(float& parameter, float& exp_avg, float& exp_avg_sq,
                                             float gradient, bool decayed,
                                             const AdamWConstants& c) {
  parameter *= decayed ? c.decay_factor : 1.0f;
  exp_avg = c.beta1 * exp_avg + (1.0f - c.beta1) * gradient;
  exp_avg_sq = c.beta2 * exp_avg_sq + (1.0f - c.beta2) * gradient * gradient;
  const float denom = sqrtf(exp_avg_sq) * c.inv_sqrt_correction2 + c.eps;
  parameter -= c.step_size * exp_avg / denom;
}

}  // namespace meshrun
