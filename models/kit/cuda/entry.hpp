// The boundary between libmeshrun_kit.so and libmeshrun_kit_cuda.so, the
// library that makes a CUDA GPU's compute (common/cuda/compute.hpp) for a
// kit stage. The kit loads it at run time, so that a model plugin links no
// CUDA library and loads on machines without one. Both are built from the
// same tree and installed side by side; the boundary is internal, not part
// of the ABI, and carries C++ objects: the compute it makes is deleted by
// the kit through its virtual destructor (both use the process's one
// allocator), and its calls throw std::runtime_error, which both see as one
// type.
#pragma once

#include <cstdint>
#include <string>

#include "common/compute.hpp"

// The library's file name, looked for next to libmeshrun_kit.so, and its
// one exported function.
#define MESHRUN_KIT_CUDA_LIBRARY "libmeshrun_kit_cuda.so"
#define MESHRUN_KIT_CUDA_SYMBOL "meshrun_kit_cuda_compute"

// Makes the compute of CUDA device `device` (made the calling thread's
// current device) enqueuing on `stream` (a cudaStream_t, borrowed; NULL:
// the legacy default stream), its GEMMs in the precision `precision`
// returns at each call. On success returns MESHRUN_OK and sets *out (owned
// by the caller). Else returns MESHRUN_UNAVAILABLE (no usable CUDA device,
// or no cuBLASLt handle) or MESHRUN_OUT_OF_RANGE (`device` past the
// process's devices), with the reason in *why.
extern "C" {
typedef int32_t (*meshrun_kit_cuda_compute_fn)(int32_t device, void* stream,
                                               meshrun::models::MatmulPrecisionSource precision,
                                               meshrun::models::Compute** out, std::string* why);
}
