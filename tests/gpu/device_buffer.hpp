// What the GPU tests share besides usable_devices.hpp: failing on a CUDA
// error, a device copy of a host vector, and random inputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
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

// `count` normal(mean, spread) values from `seed`.
inline std::vector<float> random_values(size_t count, float mean, float spread, unsigned seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<float> normal(mean, spread);
  std::vector<float> values(count);
  for (float& value : values) value = normal(engine);
  return values;
}
