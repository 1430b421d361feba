#include "gemm_peak/cuda_peak.hpp"

#include <fmt/format.h>

#include <filesystem>

#include "errors.hpp"
#include "mesh/device.hpp"
#include "numeric/cuda/peak_entry.h"
#include "plugin/loader.hpp"

namespace meshrun::train {

namespace {

// The measuring library's entry point; the library stays loaded.
meshrun_cuda_gemm_peak_fn load_peak_library() {
  const std::string path = library_folder_file(MESHRUN_CUDA_PEAK_LIBRARY);
  if (!std::filesystem::exists(path)) {
    throw invalid_argument(fmt::format(
        "--device cuda: {} is missing: this build has no CUDA GEMM peak (it was built without "
        "the CUDA toolkit's cuBLASLt)",
        path));
  }
  return reinterpret_cast<meshrun_cuda_gemm_peak_fn>(
      load_library_symbol(path, MESHRUN_CUDA_PEAK_SYMBOL, "--device cuda", MESHRUN_INTERNAL));
}

}  // namespace

CudaPeak measure_cuda_peak(int32_t device, int64_t n, double seconds) {
  const CudaDevices devices = cuda_devices();
  if (devices.count == 0) {
    throw invalid_argument(fmt::format("--device cuda: this machine has no usable CUDA device ({})",
                                       devices.why_none));
  }
  if (device < 0 || device >= devices.count) {
    throw invalid_argument(
        fmt::format("--device cuda:{}: this machine has {} CUDA device(s)", device, devices.count));
  }
  const meshrun_cuda_gemm_peak_fn measure = load_peak_library();
  meshrun_cuda_peak found{};
  char why[512] = {};
  if (measure(device, n, seconds, &found, why, sizeof why) != 0) {
    throw Error(MESHRUN_INTERNAL,
                fmt::format("--device cuda:{}: the measurement failed: {}", device, why));
  }
  return {found.device_name, found.gemm_flops_per_s, found.copy_bytes_per_s};
}

}  // namespace meshrun::train
