// Where a kit stage computes: on a CUDA device, the compute that
// libmeshrun_kit_cuda.so makes (kit/cuda/entry.hpp), loaded on first use
// from beside libmeshrun_kit.so; on the CPU the host's.
#pragma once

#include <memory>

#include "common/compute.hpp"
#include "meshrun/model.h"

namespace meshrun::kit {

// Whether this installation has the kit's CUDA compute (the kit's models
// then list "cuda" among their description's "devices").
bool cuda_compute_installed();

// The compute of the CUDA device `device` (kDLCUDA) enqueuing on `stream`
// (a cudaStream_t, borrowed), its GEMMs in the kit's matmul precision.
// Throws plugin::Error naming the device: UNIMPLEMENTED without the
// library, UNAVAILABLE when it cannot be loaded, the machine has no usable
// CUDA device or the compute cannot be made, OUT_OF_RANGE for a device id
// past the count.
std::unique_ptr<models::Compute> make_cuda_compute(DLDevice device, void* stream);

}  // namespace meshrun::kit
