// common/cuda/experts.hpp's kernels: routing one thread per row, ordering in
// one block (a thread per expert walks the slots in order, so positions are
// the CPU's, deterministically), the row moves one thread per element, the
// weights' gradients one warp per slot.
#include <algorithm>

#include "common/cuda/experts.hpp"
#include "common/expert_rows.hpp"

namespace meshrun::kernels::cuda {

namespace {

constexpr int kBlock = 256;
constexpr int kWarp = 32;
constexpr int kMaxExperts = 1024;

int blocks_for(int64_t count) {
  return int(std::min<int64_t>((count + kBlock - 1) / kBlock, int64_t(1) << 20));
}

__global__ void route_kernel(int32_t* selected, float* weights, const float* probs, int64_t rows,
                             int64_t experts, int64_t top_k) {
  for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < rows;
       n += int64_t(gridDim.x) * blockDim.x) {
    const float* p = probs + n * experts;
    int32_t* picked = selected + n * top_k;
    float sum = 0;
    for (int64_t k = 0; k < top_k; ++k) {
      int32_t best = -1;
      for (int32_t e = 0; e < int32_t(experts); ++e) {
        bool taken = false;
        for (int64_t j = 0; j < k; ++j) taken = taken || picked[j] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      picked[k] = best;
      sum += p[best];
    }
    for (int64_t k = 0; k < top_k; ++k) weights[n * top_k + k] = p[picked[k]] / sum;
  }
}

__global__ void order_slots_kernel(int64_t* tokens_per_expert, int64_t* slot_position,
                                   const int32_t* selected, int64_t slots, int64_t experts) {
  __shared__ int64_t first[kMaxExperts];
  const int64_t e = threadIdx.x;
  int64_t count = 0;
  if (e < experts) {
    for (int64_t s = 0; s < slots; ++s) count += selected[s] == e;
    tokens_per_expert[e] = count;
    first[e] = count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // exclusive prefix sum of the counts, in place
    int64_t next = 0;
    for (int64_t i = 0; i < experts; ++i) {
      const int64_t here = first[i];
      first[i] = next;
      next += here;
    }
  }
  __syncthreads();
  if (e >= experts) return;
  int64_t next = first[e];
  for (int64_t s = 0; s < slots; ++s) {
    if (selected[s] == e) slot_position[s] = next++;
  }
}

__global__ void dispatch_kernel(float* slots, const float* x, const int64_t* slot_position,
                                int64_t rows, int64_t top_k, int64_t hidden) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < rows * top_k * hidden;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t slot = k / hidden, i = k % hidden;
    slots[slot_position[slot] * hidden + i] = x[(slot / top_k) * hidden + i];
  }
}

// out[n, i] = sum_k scale_k rows[slot_position[n K + k], i]; scale 1 when
// weights is NULL.
__global__ void gather_sum_kernel(float* out, const float* rows_in, const float* weights,
                                  const int64_t* slot_position, int64_t rows, int64_t top_k,
                                  int64_t hidden) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < rows * hidden;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = k / hidden, i = k % hidden;
    float sum = 0;
    for (int64_t choice = 0; choice < top_k; ++choice) {
      const int64_t slot = n * top_k + choice;
      const float scale = weights != nullptr ? weights[slot] : 1.0f;
      sum += scale * rows_in[slot_position[slot] * hidden + i];
    }
    out[k] = sum;
  }
}

__global__ void combine_backward_kernel(float* d_slots, float* d_weights, const float* dy,
                                        const float* expert_outputs, const float* weights,
                                        const int64_t* slot_position, int64_t slots, int64_t top_k,
                                        int64_t hidden) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t slot = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; slot < slots;
       slot += warps) {
    const float* d_row = dy + (slot / top_k) * hidden;
    const int64_t at = slot_position[slot] * hidden;
    float dot = 0;
    for (int64_t i = lane; i < hidden; i += kWarp) {
      d_slots[at + i] = weights[slot] * d_row[i];
      dot += d_row[i] * expert_outputs[at + i];
    }
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    }
    if (lane == 0) d_weights[slot] = dot;
  }
}

// One thread per row, over its columns in order: the CPU twin's sums, term
// for term (a router has few experts).
__global__ void softmax_rows_kernel(float* values, int64_t rows, int64_t columns) {
  for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < rows;
       n += int64_t(gridDim.x) * blockDim.x) {
    float* row = values + n * columns;
    float top = row[0];
    for (int64_t e = 1; e < columns; ++e) top = fmaxf(top, row[e]);
    float sum = 0;
    for (int64_t e = 0; e < columns; ++e) sum += row[e] = expf(row[e] - top);
    for (int64_t e = 0; e < columns; ++e) row[e] /= sum;
  }
}

__global__ void softmax_rows_backward_kernel(float* d_values, const float* probs, int64_t rows,
                                             int64_t columns) {
  for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < rows;
       n += int64_t(gridDim.x) * blockDim.x) {
    float* d = d_values + n * columns;
    const float* p = probs + n * columns;
    float dot = 0;
    for (int64_t e = 0; e < columns; ++e) dot += d[e] * p[e];
    for (int64_t e = 0; e < columns; ++e) d[e] = p[e] * (d[e] - dot);
  }
}

// One thread per column, in double, in row order (the CPU twin's order).
__global__ void column_sums_kernel(double* sums, const float* values, int64_t rows,
                                   int64_t columns) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < columns;
       e += int64_t(gridDim.x) * blockDim.x) {
    sums[e] = column_sum(values, rows, columns, e);
  }
}

__global__ void router_gradient_kernel(float* d_probs, const float* aux_per_token,
                                       const float* probs, const int32_t* selected,
                                       const float* weights, const float* d_weights, int64_t rows,
                                       int64_t experts, int64_t top_k) {
  for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < rows;
       n += int64_t(gridDim.x) * blockDim.x) {
    router_gradient_row(d_probs + n * experts, aux_per_token, probs + n * experts,
                        selected + n * top_k, weights + n * top_k, d_weights + n * top_k, experts,
                        top_k);
  }
}

}  // namespace

cudaError_t softmax_rows(float* values, int64_t rows, int64_t columns, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  softmax_rows_kernel<<<blocks_for(rows), kBlock, 0, stream>>>(values, rows, columns);
  return cudaGetLastError();
}

cudaError_t softmax_rows_backward(float* d_values, const float* probs, int64_t rows,
                                  int64_t columns, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  softmax_rows_backward_kernel<<<blocks_for(rows), kBlock, 0, stream>>>(d_values, probs, rows,
                                                                        columns);
  return cudaGetLastError();
}

cudaError_t column_sums(double* sums, const float* values, int64_t rows, int64_t columns,
                        cudaStream_t stream) {
  if (columns == 0) return cudaSuccess;
  column_sums_kernel<<<blocks_for(columns), kBlock, 0, stream>>>(sums, values, rows, columns);
  return cudaGetLastError();
}

cudaError_t moe_router_gradient(float* d_probs, const float* aux_per_token, const float* probs,
                                const int32_t* selected, const float* weights,
                                const float* d_weights, int64_t rows, int64_t experts,
                                int64_t top_k, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  router_gradient_kernel<<<blocks_for(rows), kBlock, 0, stream>>>(
      d_probs, aux_per_token, probs, selected, weights, d_weights, rows, experts, top_k);
  return cudaGetLastError();
}

cudaError_t moe_route(int32_t* selected, float* weights, const float* probs, int64_t rows,
                      int64_t experts, int64_t top_k, cudaStream_t stream) {
  if (top_k < 1 || top_k > experts) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  route_kernel<<<blocks_for(rows), kBlock, 0, stream>>>(selected, weights, probs, rows, experts,
                                                        top_k);
  return cudaGetLastError();
}

cudaError_t moe_order_slots(int64_t* tokens_per_expert, int64_t* slot_position,
                            const int32_t* selected, int64_t rows, int64_t experts, int64_t top_k,
                            cudaStream_t stream) {
  if (experts < 1 || experts > kMaxExperts) return cudaErrorInvalidValue;
  const int threads = int((experts + kWarp - 1) / kWarp * kWarp);
  order_slots_kernel<<<1, threads, 0, stream>>>(tokens_per_expert, slot_position, selected,
                                                rows * top_k, experts);
  return cudaGetLastError();
}

cudaError_t moe_dispatch(float* slots, const float* x, const int64_t* slot_position, int64_t rows,
                         int64_t top_k, int64_t hidden, cudaStream_t stream) {
  if (rows * top_k * hidden == 0) return cudaSuccess;
  dispatch_kernel<<<blocks_for(rows * top_k * hidden), kBlock, 0, stream>>>(slots, x, slot_position,
                                                                            rows, top_k, hidden);
  return cudaGetLastError();
}

cudaError_t moe_combine(float* y, const float* expert_outputs, const float* weights,
                        const int64_t* slot_position, int64_t rows, int64_t top_k, int64_t hidden,
                        cudaStream_t stream) {
  if (rows * hidden == 0) return cudaSuccess;
  gather_sum_kernel<<<blocks_for(rows * hidden), kBlock, 0, stream>>>(
      y, expert_outputs, weights, slot_position, rows, top_k, hidden);
  return cudaGetLastError();
}

cudaError_t moe_combine_backward(float* d_slots, float* d_weights, const float* dy,
                                 const float* expert_outputs, const float* weights,
                                 const int64_t* slot_position, int64_t rows, int64_t top_k,
                                 int64_t hidden, cudaStream_t stream) {
  if (rows * top_k == 0) return cudaSuccess;
  combine_backward_kernel<<<blocks_for(rows * top_k * kWarp), kBlock, 0, stream>>>(
      d_slots, d_weights, dy, expert_outputs, weights, slot_position, rows * top_k, top_k, hidden);
  return cudaGetLastError();
}

cudaError_t moe_dispatch_backward(float* dx, const float* d_slots, const int64_t* slot_position,
                                  int64_t rows, int64_t top_k, int64_t hidden,
                                  cudaStream_t stream) {
  if (rows * hidden == 0) return cudaSuccess;
  gather_sum_kernel<<<blocks_for(rows * hidden), kBlock, 0, stream>>>(
      dx, d_slots, nullptr, slot_position, rows, top_k, hidden);
  return cudaGetLastError();
}

}  // namespace meshrun::kernels::cuda
