// The GPU's bfloat16 GEMM FLOP/s through GemmContext (cuBLASLt, float32
// accumulation) — the peak a GPU run's mfu divides by — and its
// device-to-device copy bandwidth, the memory-bound peer. Timed with events
// on the default stream after three untimed calls. Exported for `meshrun
// bench peak --device cuda` (numeric/cuda/peak_entry.h); docs/testing.md
// says whether it has run on a GPU.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "numeric/cuda/gemm.hpp"
#include "numeric/cuda/peak_entry.h"

namespace {

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(status));
}

// Seconds per call of `run`, from as many calls as fit in `seconds`.
template <class Run>
double seconds_per_call(Run&& run, double seconds) {
  for (int i = 0; i < 3; ++i) run();
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  int calls = 0;
  check(cudaEventRecord(start), "cudaEventRecord");
  const auto wall = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - wall).count() < seconds) {
    run();
    // Bounds the queue, so the wall clock measures work done, not enqueued.
    if (++calls % 8 == 0) check(cudaDeviceSynchronize(), "a timed call");
  }
  check(cudaEventRecord(stop), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float elapsed_ms = 0;
  check(cudaEventElapsedTime(&elapsed_ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return double(elapsed_ms) / 1e3 / calls;
}

// Device memory freed with the measurement, even when it throws.
struct DeviceBytes {
  explicit DeviceBytes(size_t bytes) { check(cudaMalloc(&data, bytes), "cudaMalloc"); }
  ~DeviceBytes() { cudaFree(data); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  void* data = nullptr;
};

void measure(int32_t device, int64_t n, double seconds, meshrun_cuda_peak& out) {
  check(cudaSetDevice(device), "cudaSetDevice");
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
  std::snprintf(out.device_name, sizeof out.device_name, "%s", properties.name);
  const size_t elements = size_t(n) * size_t(n);
  DeviceBytes a(elements * 2), b(elements * 2), c(elements * 4);
  // 0x3f3f: bfloat16 0.75, finite, so the GEMM runs at its normal rate.
  check(cudaMemset(a.data, 0x3f, elements * 2), "cudaMemset");
  check(cudaMemset(b.data, 0x3f, elements * 2), "cudaMemset");
  const meshrun::kernels::cuda::GemmContext context;
  if (!context.ok()) throw std::runtime_error("cublasLtCreate failed");
  const auto* a_bits = static_cast<const uint16_t*>(a.data);
  const auto* b_bits = static_cast<const uint16_t*>(b.data);
  auto* c_floats = static_cast<float*>(c.data);
  const double gemm_s = seconds_per_call(
      [&] {
        if (context.gemm_bfloat16(false, true, n, n, n, 1.0f, a_bits, n, b_bits, n, 0.0f, c_floats,
                                  n, nullptr) != CUBLAS_STATUS_SUCCESS) {
          throw std::runtime_error("cublasLtMatmul failed");
        }
      },
      seconds);
  out.gemm_flops_per_s = 2.0 * double(n) * double(n) * double(n) / gemm_s;
  const double copy_s = seconds_per_call(
      [&] {
        check(cudaMemcpyAsync(c.data, a.data, elements * 2, cudaMemcpyDeviceToDevice),
              "cudaMemcpyAsync");
      },
      seconds);
  out.copy_bytes_per_s = 2.0 * double(elements * 2) / copy_s;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int meshrun_cuda_gemm_peak(
    int32_t device, int64_t n, double seconds, meshrun_cuda_peak* out, char* why, size_t why_size) {
  try {
    if (out == nullptr || n < 1 || seconds <= 0) throw std::invalid_argument("bad arguments");
    measure(device, n, seconds, *out);
    return 0;
  } catch (const std::exception& e) {
    if (why != nullptr && why_size > 0) std::snprintf(why, why_size, "%s", e.what());
    return 1;
  }
}
