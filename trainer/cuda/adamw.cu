// trainer/cuda/adamw.hpp: one thread per element, grid-stride.
#include <algorithm>

#include "cuda/adamw.hpp"

namespace meshrun::train::cuda {

namespace {

__global__ void adamw_kernel(float* parameters, float* exp_avg, float* exp_avg_sq,
                             const float* gradients, const uint8_t* decay, int64_t count,
                             AdamWConstants constants) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    adamw_update(parameters[i], exp_avg[i], exp_avg_sq[i], gradients[i], decay[i] != 0, constants);
  }
}

}  // namespace

cudaError_t adamw_step(float* parameters, float* exp_avg, float* exp_avg_sq, const float* gradients,
                       const uint8_t* decay, int64_t count, const AdamWConstants& constants,
                       cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  constexpr int kBlock = 256;
  const int64_t blocks = std::min<int64_t>((count + kBlock - 1) / kBlock, int64_t(1) << 20);
  adamw_kernel<<<int(blocks), kBlock, 0, stream>>>(parameters, exp_avg, exp_avg_sq, gradients,
                                                   decay, count, constants);
  return cudaGetLastError();
}

}  // namespace meshrun::train::cuda
