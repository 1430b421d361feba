// A CUDA GPU's state device (state/state_device.hpp): the trainer's
// parameters, gradients and AdamW moments in the GPU's memory, and the
// step's arithmetic on them as kernels of its own (the AdamW update is
// cuda/adamw.hpp's), every call enqueued on one stream.
//
// This code has compiled but never run on a GPU (docs/testing.md).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "state/state_device.hpp"

namespace meshrun::train::cuda {

// The state device of GPU `device` (made the calling thread's current
// device), enqueuing on `stream` (borrowed; it must outlive the device).
std::unique_ptr<StateDevice> make_state_device(int device, cudaStream_t stream);

}  // namespace meshrun::train::cuda
