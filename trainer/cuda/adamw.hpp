// The CUDA twin of the optimizer's update (state/optimizer.hpp's AdamW):
// each element updated by the same function the CPU loop calls
// (state/adamw_update.hpp), on device buffers. Enqueued on `stream`,
// returns without waiting.
//
// This code has compiled but never run on a GPU (docs/testing.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "state/adamw_update.hpp"

namespace meshrun::train::cuda {

// One AdamW step of `count` elements with the step's `constants`
// (adamw_constants); `decay[i]` != 0 where element i gets weight decay.
cudaError_t adamw_step(float* parameters, float* exp_avg, float* exp_avg_sq, const float* gradients,
                       const uint8_t* decay, int64_t count, const AdamWConstants& constants,
                       cudaStream_t stream);

}  // namespace meshrun::train::cuda
