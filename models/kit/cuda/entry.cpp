// libmeshrun_kit_cuda.so's one function (kit/cuda/entry.hpp): a CUDA GPU's
// compute for a kit stage, after checking that the device is there.
//
// This code has compiled but never run on a GPU (docs/testing.md).
#include "kit/cuda/entry.hpp"

#include <cuda_runtime_api.h>

#include <exception>
#include <memory>
#include <string>

#include "common/cuda/compute.hpp"
#include "meshrun/error.h"

namespace {

// MESHRUN_OK when `device` is one of the process's CUDA devices, else the
// code with the reason in *why.
int32_t check_device(int32_t device, std::string* why) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    cudaGetLastError();
    *why = "no usable CUDA device (" +
           std::string(status != cudaSuccess ? cudaGetErrorString(status) : "none found") + ")";
    return MESHRUN_UNAVAILABLE;
  }
  if (device < 0 || device >= count) {
    *why = "cuda:" + std::to_string(device) + " is past this process's " + std::to_string(count) +
           " CUDA device(s) (CUDA_VISIBLE_DEVICES selects and renumbers them)";
    return MESHRUN_OUT_OF_RANGE;
  }
  return MESHRUN_OK;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int32_t meshrun_kit_cuda_compute(
    int32_t device, void* stream, meshrun::models::MatmulPrecisionSource precision,
    meshrun::models::Compute** out, std::string* why) {
  if (const int32_t code = check_device(device, why); code != MESHRUN_OK) return code;
  try {
    *out = meshrun::models::make_cuda_compute(device, static_cast<cudaStream_t>(stream), precision)
               .release();
    return MESHRUN_OK;
  } catch (const std::exception& e) {
    *why = e.what();
    return MESHRUN_UNAVAILABLE;
  }
}

// The entry's type is the one the kit expects.
static_assert(std::is_same_v<decltype(&meshrun_kit_cuda_compute), meshrun_kit_cuda_compute_fn>);
