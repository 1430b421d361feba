// Benchmark: the GPU's bfloat16 GEMM FLOP/s through numeric/cuda/gemm.hpp
// (cuBLASLt, float32 accumulation), the peak a GPU run's mfu would divide
// by, beside the float32-output GEMM the models' linears use; and the
// device-to-device copy bandwidth, the memory-bound peer. Prints one line
// per figure and a JSON summary; exits 77 without a usable GPU.
//
//   meshrun_gpu_gemm_peak [SIZE] [SECONDS]     (default 8192, 2)
//
// This benchmark has compiled but never run on a GPU (docs/testing.md).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "numeric/cuda/gemm.hpp"
#include "usable_devices.hpp"

namespace {

void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "FAIL %s\n", what);
  std::exit(1);
}

// Seconds per call of `run`, from as many calls as fit in `seconds` after
// three untimed ones, timed with events on the default stream.
template <class Run>
double seconds_per_call(Run&& run, double seconds) {
  for (int i = 0; i < 3; ++i) run();
  cudaEvent_t start, stop;
  require(cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess,
          "cudaEventCreate");
  int calls = 0;
  float elapsed_ms = 0;
  require(cudaEventRecord(start) == cudaSuccess, "cudaEventRecord");
  const auto wall = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - wall).count() < seconds) {
    run();
    ++calls;
    if (calls % 8 == 0) require(cudaDeviceSynchronize() == cudaSuccess, "kernel");
  }
  require(cudaEventRecord(stop) == cudaSuccess && cudaEventSynchronize(stop) == cudaSuccess,
          "cudaEventSynchronize");
  require(cudaEventElapsedTime(&elapsed_ms, start, stop) == cudaSuccess, "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return double(elapsed_ms) / 1e3 / calls;
}

}  // namespace

int main(int argc, char** argv) {
  if (!usable_cuda_devices()) return kSkip;
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 8192;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 2.0;
  cudaDeviceProp properties{};
  require(cudaGetDeviceProperties(&properties, 0) == cudaSuccess, "cudaGetDeviceProperties");
  uint16_t *a = nullptr, *b = nullptr;
  float* c = nullptr;
  const size_t elements = size_t(n * n);
  require(cudaMalloc(&a, elements * 2) == cudaSuccess &&
              cudaMalloc(&b, elements * 2) == cudaSuccess &&
              cudaMalloc(&c, elements * 4) == cudaSuccess,
          "cudaMalloc");
  require(cudaMemset(a, 0x3f, elements * 2) == cudaSuccess &&
              cudaMemset(b, 0x3f, elements * 2) == cudaSuccess,
          "cudaMemset");
  const meshrun::kernels::cuda::GemmContext context;
  require(context.ok(), "cublasLtCreate");
  const double gemm_s = seconds_per_call(
      [&] {
        require(context.gemm_bfloat16(false, true, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n, 0) ==
                    CUBLAS_STATUS_SUCCESS,
                "gemm_bfloat16");
      },
      seconds);
  const double flops = 2.0 * double(n) * double(n) * double(n) / gemm_s;
  const double copy_s = seconds_per_call(
      [&] {
        require(cudaMemcpyAsync(c, a, elements * 2, cudaMemcpyDeviceToDevice) == cudaSuccess,
                "cudaMemcpyAsync");
      },
      seconds);
  const double copy_bytes_per_s = 2.0 * double(elements * 2) / copy_s;  // read and write
  std::printf(
      "%s: bfloat16 GEMM %ld^3 (float32 accumulation and output, A B^T as a linear's "
      "forward): %.1f TFLOP/s\n",
      properties.name, long(n), flops / 1e12);
  std::printf("%s: device-to-device copy of %.0f MiB: %.0f GB/s (read + write)\n", properties.name,
              double(elements * 2) / (1 << 20), copy_bytes_per_s / 1e9);
  std::printf(
      "{\"device\": \"%s\", \"gemm_size\": %ld, \"bfloat16_gemm_flops_per_s\": %.6g, "
      "\"copy_bytes_per_s\": %.6g}\n",
      properties.name, long(n), flops, copy_bytes_per_s);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 0;
}
