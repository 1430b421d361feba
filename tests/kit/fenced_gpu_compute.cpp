// A stand-in for libmeshrun_kit_cuda.so (models/kit/cuda/entry.hpp) on
// machines without a GPU: the same entry point, making a fenced compute
// (tests/unit/fenced_compute.hpp: the host's kernels on memory that faults
// outside the compute's calls) for "cuda:0", the one device it has. It is
// built under the real library's name into a folder of its own, beside a
// link to libmeshrun_kit.so, so that a kit model plugin loaded from there
// computes a CUDA stage on it (test_kit_device_stage.cpp). The test reaches
// the same memory through the fenced_gpu_* functions, as a trainer reaches
// a GPU's through the CUDA runtime.
#include <cstdint>
#include <cstring>
#include <string>

#include "fenced_compute.hpp"
#include "kit/cuda/entry.hpp"
#include "meshrun/error.h"

#define FENCED_GPU_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

fenced::FencedMemory& memory() {
  static fenced::FencedMemory shared;
  return shared;
}

// What the kit asked for last.
int32_t last_device = -1;
void* last_stream = nullptr;
int64_t computes_made = 0;

}  // namespace

FENCED_GPU_EXPORT int32_t meshrun_kit_cuda_compute(int32_t device, void* stream,
                                                   meshrun::models::MatmulPrecisionSource precision,
                                                   meshrun::models::Compute** out,
                                                   std::string* why) {
  last_device = device;
  last_stream = stream;
  if (device != 0) {
    *why = "cuda:" + std::to_string(device) +
           " is past this process's 1 CUDA device(s) (the fenced stand-in's one)";
    return MESHRUN_OUT_OF_RANGE;
  }
  *out = new fenced::FencedCompute(memory(), precision);
  ++computes_made;
  return MESHRUN_OK;
}

FENCED_GPU_EXPORT void* fenced_gpu_allocate(int64_t bytes) { return memory().allocate(bytes); }
FENCED_GPU_EXPORT void fenced_gpu_release(void* pointer) { memory().release(pointer); }
FENCED_GPU_EXPORT void fenced_gpu_copy(void* to, const void* from, int64_t bytes) {
  memory().opened([&] { std::memcpy(to, from, size_t(bytes)); });
}
FENCED_GPU_EXPORT int32_t fenced_gpu_last_device() { return last_device; }
FENCED_GPU_EXPORT void* fenced_gpu_last_stream() { return last_stream; }
FENCED_GPU_EXPORT int64_t fenced_gpu_computes_made() { return computes_made; }

static_assert(std::is_same_v<decltype(&meshrun_kit_cuda_compute), meshrun_kit_cuda_compute_fn>);
