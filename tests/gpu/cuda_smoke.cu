// Proves the CUDA toolchain builds and, where a GPU exists, runs a kernel
// and gets the right answer. Without a usable GPU it exits 77, which ctest
// reports as skipped, and says why.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "usable_devices.hpp"

// y[i] = a * x[i] + y[i]
__global__ void saxpy(int n, float a, const float* x, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

namespace {

bool check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
  return false;
}

}  // namespace

int main() {
  const std::optional<int> usable = usable_cuda_devices();
  if (!usable) return kSkip;
  const int devices = *usable;
  const int n = 1 << 20;
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i % 97);
    y[i] = 1.0f;
  }
  float *dx = nullptr, *dy = nullptr;
  const size_t bytes = n * sizeof(float);
  if (!check(cudaMalloc(&dx, bytes), "cudaMalloc") ||
      !check(cudaMalloc(&dy, bytes), "cudaMalloc") ||
      !check(cudaMemcpy(dx, x.data(), bytes, cudaMemcpyHostToDevice), "copy x") ||
      !check(cudaMemcpy(dy, y.data(), bytes, cudaMemcpyHostToDevice), "copy y")) {
    return 1;
  }
  saxpy<<<(n + 255) / 256, 256>>>(n, 2.0f, dx, dy);
  if (!check(cudaGetLastError(), "launch") ||
      !check(cudaMemcpy(y.data(), dy, bytes, cudaMemcpyDeviceToHost), "copy back")) {
    return 1;
  }
  cudaFree(dx);
  cudaFree(dy);
  for (int i = 0; i < n; ++i) {
    if (y[i] != 2.0f * static_cast<float>(i % 97) + 1.0f) {
      std::fprintf(stderr, "mismatch at %d: %f\n", i, y[i]);
      return 1;
    }
  }
  std::printf("saxpy on %d elements matches on %d device(s)\n", n, devices);
  return 0;
}
