// What the GPU tests share besides usable_devices.hpp: failing on a CUDA
// error, a device copy of a host vector, comparing with the CPU within a
// bound, and random inputs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

// Exits 1 naming `what` unless `status` is success.
inline void require(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  std::fprintf(stderr, "FAIL %s: %s\n", what, cudaGetErrorString(status));
  std::exit(1);
}

// A device copy of a host vector, copied back on request.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<T>& host) : size_(host.size()) {
    require(cudaMalloc(&data_, size_ * sizeof(T)), "cudaMalloc");
    require(cudaMemcpy(data_, host.data(), size_ * sizeof(T), cudaMemcpyHostToDevice), "to device");
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() { return data_; }
  // The values after every kernel enqueued so far.
  std::vector<T> host() const {
    std::vector<T> values(size_);
    require(cudaDeviceSynchronize(), "kernel");
    require(cudaMemcpy(values.data(), data_, size_ * sizeof(T), cudaMemcpyDeviceToHost), "to host");
    return values;
  }

 private:
  T* data_ = nullptr;
  size_t size_;
};

// How close a GPU value must be to its CPU twin:
// |gpu - cpu| <= absolute + relative |cpu|.
struct Bound {
  double absolute, relative;
};

// Whether there are as many gpu values as cpu ones and each is within
// `bound` of its twin; prints the largest difference when not.
template <typename T>
bool within(const std::string& what, const std::vector<T>& gpu, const std::vector<T>& cpu,
            Bound bound) {
  double worst = 0;
  bool close = gpu.size() == cpu.size();
  for (size_t i = 0; i < cpu.size() && i < gpu.size(); ++i) {
    const double error = std::abs(double(gpu[i]) - double(cpu[i]));
    worst = std::max(worst, error);
    close = close && error <= bound.absolute + bound.relative * std::abs(double(cpu[i]));
  }
  if (!close) std::printf("  %s: largest difference %.3g\n", what.c_str(), worst);
  return close;
}

// `count` normal(mean, spread) values from `seed`.
inline std::vector<float> random_values(size_t count, float mean, float spread, unsigned seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<float> normal(mean, spread);
  std::vector<float> values(count);
  for (float& value : values) value = normal(engine);
  return values;
}
