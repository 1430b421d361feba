// The GPU tests' first step: how many CUDA devices this process can use, or,
// when none, a printed reason and the exit status ctest reports as skipped.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <optional>

inline constexpr int kSkip = 77;  // SKIP_RETURN_CODE of every GPU test

// The number of usable devices, or nullopt after printing why there is none.
inline std::optional<int> usable_cuda_devices() {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("SKIP: no usable CUDA device (%s)\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    return std::nullopt;
  }
  return devices;
}
