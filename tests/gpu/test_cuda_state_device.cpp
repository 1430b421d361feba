// The GPU's state device (trainer/cuda/state_device.hpp) against the
// host's (state/state_device.hpp), call by call, on 10,001 elements (a
// partial block): zeroing and scaling, rounding to bfloat16 and float16
// (subnormals, overflow and a NaN among the values) and copies bit for
// bit; the squared norm within 1e-12 relative (double sums in another
// order); the finiteness check exactly (a NaN, an infinity, none); and the
// optimizer itself (state/optimizer.hpp's AdamW, its moments on each
// device) over three steps with torch's default betas, weight decay on
// half the elements and a learning rate that changes. Without a usable GPU
// it exits 77.
//
// AdamW's tolerance: |gpu - cpu| <= 1e-6 + 1e-5 |cpu| for parameters and
// moments. Both run the same function per element (state/adamw_update.hpp)
// in float32; nvcc contracts a * b + c into one rounding (fused
// multiply-add) where the CPU build may round twice, which moves a result
// by an ulp or so per step (~1e-7 relative); a wrong term moves it by the
// step size, ~1e-3.
//
// This test has compiled but never run on a GPU (docs/testing.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/state_device.hpp"
#include "state/optimizer.hpp"
#include "usable_devices.hpp"

namespace {

using meshrun::StateArray;
using meshrun::StateDevice;

int failures = 0;
constexpr int64_t kCount = 10001;

void report(bool passed, const std::string& what) {
  std::printf("%s %s\n", passed ? "PASS" : "FAIL", what.c_str());
  if (!passed) ++failures;
}

// Values of `device` copied from and back to the host.
StateArray<float> on(StateDevice& device, const std::vector<float>& host) {
  StateArray<float> array(int64_t(host.size()), device);
  device.copy_from_host(array.data(), host.data(), int64_t(host.size() * sizeof(float)));
  return array;
}
std::vector<float> back(StateDevice& device, const StateArray<float>& array) {
  std::vector<float> host(size_t(array.size()));
  device.copy_to_host(host.data(), array.data(), int64_t(host.size() * sizeof(float)));
  return host;
}

// Equal bit for bit (NaN to any NaN).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return false;
  }
  return true;
}

std::vector<float> random_values(uint32_t seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(kCount));
  for (float& value : values) value = normal(engine);
  return values;
}

void check_element_wise(StateDevice& gpu, StateDevice& cpu) {
  std::vector<float> values = random_values(3);
  values[1] = 1e-41f;       // a float32 subnormal
  values[2] = 3e-6f;        // a float16 subnormal
  values[3] = 70000.0f;     // past float16's largest
  values[4] = 1.00390625f;  // a bfloat16 tie
  values[5] = std::numeric_limits<float>::quiet_NaN();
  for (const char* dtype : {"bfloat16", "float16", "float32"}) {
    StateArray<float> device = on(gpu, values);
    std::vector<float> host = values;
    gpu.round_to(device.data(), kCount, dtype);
    cpu.round_to(host.data(), kCount, dtype);
    report(same_bits(back(gpu, device), host), std::string("round_to ") + dtype + " bit for bit");
  }
  values[5] = 0.5f;
  StateArray<float> device = on(gpu, values);
  std::vector<float> host = values;
  gpu.scale(device.data(), kCount, 0.37f);
  cpu.scale(host.data(), kCount, 0.37f);
  report(same_bits(back(gpu, device), host), "scale bit for bit");
  const double gpu_norm = gpu.squared_norm(device.data(), kCount);
  const double cpu_norm = cpu.squared_norm(host.data(), kCount);
  report(std::abs(gpu_norm - cpu_norm) <= 1e-12 * cpu_norm,
         "squared_norm " + std::to_string(gpu_norm) + " vs " + std::to_string(cpu_norm));
  report(gpu.all_finite(device.data(), kCount), "all_finite of finite values");
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    std::vector<float> with_bad = values;
    with_bad[kCount - 1] = bad;
    StateArray<float> bad_device = on(gpu, with_bad);
    report(
        !gpu.all_finite(bad_device.data(), kCount) && gpu.all_finite(bad_device.data(), kCount - 1),
        std::string("all_finite sees ") + (std::isnan(bad) ? "a NaN" : "an infinity") +
            " at the last element only");
  }
  gpu.zero(device.data(), kCount);
  report(back(gpu, device) == std::vector<float>(size_t(kCount), 0.0f), "zero");
}

void check_adamw(StateDevice& gpu, StateDevice& cpu) {
  meshrun::TrainConfig train;
  train.beta1 = 0.9;
  train.beta2 = 0.999;
  train.eps = 1e-8;
  train.weight_decay = 0.1;
  std::vector<uint8_t> decay(static_cast<size_t>(kCount));
  for (size_t i = 0; i < decay.size(); ++i) decay[i] = uint8_t(i % 2);
  meshrun::AdamW cpu_optimizer(train, decay, cpu), gpu_optimizer(train, decay, gpu);
  std::vector<float> parameters = random_values(7);
  StateArray<float> gpu_parameters = on(gpu, parameters);
  for (int64_t step = 1; step <= 3; ++step) {
    const std::vector<float> gradients = random_values(uint32_t(10 + step));
    const StateArray<float> gpu_gradients = on(gpu, gradients);
    const double lr = 1e-3 * double(step);
    cpu_optimizer.step(parameters.data(), gradients.data(), lr);
    gpu_optimizer.step(gpu_parameters.data(), gpu_gradients.data(), lr);
  }
  const auto host_of = [](const float* values) {
    return std::vector<float>(values, values + kCount);
  };
  const auto gpu_host_of = [&](const float* values) {
    std::vector<float> host(static_cast<size_t>(kCount));
    gpu.copy_to_host(host.data(), values, kCount * int64_t(sizeof(float)));
    return host;
  };
  const std::vector<std::vector<float>> expected{parameters, host_of(cpu_optimizer.exp_avg()),
                                                 host_of(cpu_optimizer.exp_avg_sq())};
  const std::vector<std::vector<float>> got{back(gpu, gpu_parameters),
                                            gpu_host_of(gpu_optimizer.exp_avg()),
                                            gpu_host_of(gpu_optimizer.exp_avg_sq())};
  const char* names[] = {"parameters", "exp_avg", "exp_avg_sq"};
  for (size_t k = 0; k < 3; ++k) {
    double worst = 0;
    bool within = true;
    for (size_t i = 0; i < size_t(kCount); ++i) {
      const double error = std::abs(double(got[k][i]) - double(expected[k][i]));
      worst = std::max(worst, error);
      within = within && error <= 1e-6 + 1e-5 * std::abs(double(expected[k][i]));
    }
    report(within, std::string("AdamW ") + names[k] + " after 3 steps (largest difference " +
                       std::to_string(worst) + ")");
  }
}

}  // namespace

int main() {
  if (!usable_cuda_devices()) return kSkip;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreate(&stream) != cudaSuccess) {
    std::printf("FAIL cudaStreamCreate\n");
    return 1;
  }
  try {
    const std::unique_ptr<StateDevice> gpu = meshrun::train::cuda::make_state_device(0, stream);
    check_element_wise(*gpu, meshrun::host_state_device());
    check_adamw(*gpu, meshrun::host_state_device());
  } catch (const std::exception& e) {
    report(false, e.what());
  }
  cudaStreamDestroy(stream);
  std::printf("%d of the state device's GPU checks failed\n", failures);
  return failures == 0 ? 0 : 1;
}
