// The CUDA twin of the optimizer's update (trainer/cuda/adamw.hpp) against
// the CPU's AdamW (state/optimizer.hpp): three steps with torch's default
// betas, weight decay on half the elements, a learning rate that changes,
// on 10,001 elements (a partial block). Without a usable GPU it exits 77.
//
// Tolerance: |gpu - cpu| <= 1e-6 + 1e-5 |cpu| for parameters and moments.
// Both run the same function per element (state/adamw_update.hpp) in
// float32; nvcc contracts a * b + c into one rounding (fused multiply-add)
// where the CPU build may round twice, which moves a result by an ulp or so
// per step (~1e-7 relative); a wrong term moves it by the step size, ~1e-3.
//
// This test has compiled but never run on a GPU (docs/testing.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/adamw.hpp"
#include "device_buffer.hpp"
#include "state/optimizer.hpp"
#include "usable_devices.hpp"

namespace {

int failures = 0;

void compare(const char* what, const std::vector<float>& gpu, const std::vector<float>& cpu) {
  double worst = 0;
  bool within = true;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double error = std::abs(double(gpu[i]) - double(cpu[i]));
    worst = std::max(worst, error);
    within = within && error <= 1e-6 + 1e-5 * std::abs(double(cpu[i]));
  }
  std::printf("%s AdamW %s after 3 steps (largest difference %.3g)\n", within ? "PASS" : "FAIL",
              what, worst);
  if (!within) ++failures;
}

}  // namespace

int main() {
  if (!usable_cuda_devices()) return kSkip;
  constexpr size_t kCount = 10001;
  meshrun::TrainConfig train;
  train.beta1 = 0.9;
  train.beta2 = 0.999;
  train.eps = 1e-8;
  train.weight_decay = 0.1;
  std::vector<uint8_t> decay(kCount);
  for (size_t i = 0; i < kCount; ++i) decay[i] = uint8_t(i % 2);
  std::mt19937 engine(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> parameters(kCount), gradients(kCount);
  for (float& value : parameters) value = normal(engine);

  meshrun::AdamW cpu_optimizer(train, decay);
  DeviceBuffer<float> gpu_parameters(parameters), gpu_exp_avg(std::vector<float>(kCount, 0.0f)),
      gpu_exp_avg_sq(std::vector<float>(kCount, 0.0f)), gpu_gradients(gradients);
  DeviceBuffer<uint8_t> gpu_decay(decay);
  for (int64_t step = 1; step <= 3; ++step) {
    for (float& value : gradients) value = normal(engine);
    require(cudaMemcpy(gpu_gradients.get(), gradients.data(), kCount * sizeof(float),
                       cudaMemcpyHostToDevice),
            "gradients to device");
    const double lr = 1e-3 * double(step);
    cpu_optimizer.step(parameters.data(), gradients.data(), lr);
    require(meshrun::train::cuda::adamw_step(
                gpu_parameters.get(), gpu_exp_avg.get(), gpu_exp_avg_sq.get(), gpu_gradients.get(),
                gpu_decay.get(), int64_t(kCount),
                meshrun::adamw_constants(lr, train.beta1, train.beta2, train.eps,
                                         train.weight_decay, step),
                0),
            "adamw_step");
  }
  compare("parameters", gpu_parameters.host(), parameters);
  compare("exp_avg", gpu_exp_avg.host(), cpu_optimizer.exp_avg());
  compare("exp_avg_sq", gpu_exp_avg_sq.host(), cpu_optimizer.exp_avg_sq());
  std::printf("%d of the CUDA AdamW's checks failed\n", failures);
  return failures == 0 ? 0 : 1;
}
