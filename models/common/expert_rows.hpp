// The per-row and per-column bodies of a mixture's kernels that the CPU
// loops (common/experts.hpp) and their CUDA twins (common/cuda/experts.cu)
// run alike, in one place: a header both compilers read, plain C++17, each
// function compiled for the host and, under nvcc, for the GPU.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MESHRUN_MODEL_HOST_DEVICE __host__ __device__
#else
#define MESHRUN_MODEL_HOST_DEVICE
#endif

namespace meshrun::kernels {

// The sum over rows of column e of values [rows, columns], in double, in
// row order.
MESHRUN_MODEL_HOST_DEVICE inline double column_sum(const float* values, int64_t rows,
                                                   int64_t columns, int64_t e) {
  double sum = 0;
  for (int64_t n = 0; n < rows; ++n) sum += values[n * columns + e];
  return sum;
}

// One row n of the router probabilities' gradient d [E] (moe_router_gradient
// in common/experts.hpp says what it is): from the row's probabilities p
// [E], its top_k choices, their routing weights and those weights'
// gradients, and the load-balancing loss's aux_per_token [E].
MESHRUN_MODEL_HOST_DEVICE inline void router_gradient_row(float* d, const float* aux_per_token,
                                                          const float* p, const int32_t* selected,
                                                          const float* weights,
                                                          const float* d_weights, int64_t experts,
                                                          int64_t top_k) {
  for (int64_t e = 0; e < experts; ++e) d[e] = aux_per_token[e];
  float sum = 0, weighted = 0;
  for (int64_t k = 0; k < top_k; ++k) {
    sum += p[selected[k]];
    weighted += d_weights[k] * weights[k];
  }
  for (int64_t k = 0; k < top_k; ++k) d[selected[k]] += (d_weights[k] - weighted) / sum;
}

}  // namespace meshrun::kernels
