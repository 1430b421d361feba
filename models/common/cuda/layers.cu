// common/cuda/layers.hpp's kernels. A row's reductions run in one block of
// kBlock threads (a warp-shuffle tree, then the warps' partial results);
// the weight gradients sum over rows one column per thread, in row order,
// as the CPU twins do, so they need no atomics and give the same result on
// every run.
#include <cuda_bf16.h>

#include <cmath>

#include "common/cuda/layers.hpp"

namespace meshrun::kernels::cuda {

namespace {

constexpr int kBlock = 256;
constexpr int kWarp = 32;
constexpr int64_t kMaxRowBlocks = 1 << 20;  // rows past it loop within a block
constexpr double kSqrt2OverPi = 0.7978845608028654;

int row_blocks(int64_t rows) { return int(rows < kMaxRowBlocks ? rows : kMaxRowBlocks); }
int element_blocks(int64_t count) {
  const int64_t blocks = (count + kBlock - 1) / kBlock;
  return int(blocks < kMaxRowBlocks ? blocks : kMaxRowBlocks);
}

struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
  static constexpr float kIdentity = 0.0f;
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
  static constexpr float kIdentity = -INFINITY;
};

// The reduction of every thread's `value` over the block, handed to every
// thread. `shared` holds kBlock / kWarp floats.
template <class Op>
__device__ float block_reduce(float value, float* shared) {
  const Op op;
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = threadIdx.x < kBlock / kWarp ? shared[threadIdx.x] : Op::kIdentity;
  if (warp == 0) {
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
    }
    if (lane == 0) shared[0] = value;
  }
  __syncthreads();
  const float result = shared[0];
  __syncthreads();
  return result;
}

// y = x r w, r = (mean x^2 + eps)^(-1/2)
__global__ void rmsnorm_forward_kernel(float* y, float* rstd, const float* x, const float* weight,
                                       int64_t rows, int64_t dim, float eps) {
  __shared__ float shared[kBlock / kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* x_row = x + row * dim;
    float sum_squares = 0;
    for (int64_t i = threadIdx.x; i < dim; i += kBlock) sum_squares += x_row[i] * x_row[i];
    const float r = rsqrtf(block_reduce<Sum>(sum_squares, shared) / float(dim) + eps);
    for (int64_t i = threadIdx.x; i < dim; i += kBlock) y[row * dim + i] = x_row[i] * r * weight[i];
    if (threadIdx.x == 0) rstd[row] = r;
  }
}

// dx += r (dy w - x r^2 / dim sum_i dy_i w_i x_i)
__global__ void rmsnorm_input_gradient(float* dx, const float* dy, const float* x,
                                       const float* weight, const float* rstd, int64_t rows,
                                       int64_t dim) {
  __shared__ float shared[kBlock / kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* x_row = x + row * dim;
    const float* dy_row = dy + row * dim;
    float dot = 0;
    for (int64_t i = threadIdx.x; i < dim; i += kBlock) dot += dy_row[i] * weight[i] * x_row[i];
    const float r = rstd[row];
    const float coefficient = r * r * block_reduce<Sum>(dot, shared) / float(dim);
    for (int64_t i = threadIdx.x; i < dim; i += kBlock) {
      dx[row * dim + i] += r * (dy_row[i] * weight[i] - x_row[i] * coefficient);
    }
  }
}

// d_weight_i += sum over rows of dy_i x_i r (and d_bias_i += dy_i with a
// LayerNorm's mean: x_i - m in place of x_i).
__global__ void norm_weight_gradient(float* d_weight, float* d_bias, const float* dy,
                                     const float* x, const float* mean, const float* rstd,
                                     int64_t rows, int64_t dim) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < dim;
       i += int64_t(gridDim.x) * blockDim.x) {
    float weight_sum = 0, bias_sum = 0;
    for (int64_t row = 0; row < rows; ++row) {
      const float centered = x[row * dim + i] - (mean != nullptr ? mean[row] : 0.0f);
      weight_sum += dy[row * dim + i] * centered * rstd[row];
      bias_sum += dy[row * dim + i];
    }
    d_weight[i] += weight_sum;
    if (d_bias != nullptr) d_bias[i] += bias_sum;
  }
}

// y = (x - m) r w + b
__global__ void layernorm_forward_kernel(float* y, float* mean, float* rstd, const float* x,
                                         const float* weight, const float* bias, int64_t rows,
                                         int64_t dim, float eps) {
  __shared__ float shared[kBlock / kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* x_row = x + row * dim;
    float sum = 0;
    for (int64_t i = threadIdx.x; i < dim; i += kBlock) sum += x_row[i];
    const float m = block_reduce<Sum>(sum, shared) / float(dim);
    float sum_squares = 0;
    for (int64_t i = threadIdx.x; i < dim; i += kBlock) {
      sum_squares += (x_row[i] - m) * (x_row[i] - m);
    }
    const float r = rsqrtf(block_reduce<Sum>(sum_squares, shared) / float(dim) + eps);
    for (int64_t i = threadIdx.x; i < dim; i += kBlock) {
      y[row * dim + i] = (x_row[i] - m) * r * weight[i] + bias[i];
    }
    if (threadIdx.x == 0) {
      mean[row] = m;
      rstd[row] = r;
    }
  }
}

// dx += r (g - mean g - n mean(g n)), g = dy w, n = (x - m) r
__global__ void layernorm_input_gradient(float* dx, const float* dy, const float* x,
                                         const float* weight, const float* mean, const float* rstd,
                                         int64_t rows, int64_t dim) {
  __shared__ float shared[kBlock / kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* x_row = x + row * dim;
    const float* dy_row = dy + row * dim;
    const float m = mean[row], r = rstd[row];
    float g_sum = 0, gn_sum = 0;
    for (int64_t i = threadIdx.x; i < dim; i += kBlock) {
      const float g = dy_row[i] * weight[i];
      g_sum += g;
      gn_sum += g * (x_row[i] - m) * r;
    }
    const float g_mean = block_reduce<Sum>(g_sum, shared) / float(dim);
    const float gn_mean = block_reduce<Sum>(gn_sum, shared) / float(dim);
    for (int64_t i = threadIdx.x; i < dim; i += kBlock) {
      const float n = (x_row[i] - m) * r;
      dx[row * dim + i] += r * (dy_row[i] * weight[i] - g_mean - n * gn_mean);
    }
  }
}

// out[r, :] = table[tokens[r] - begin, :], zero for a token outside the
// shard [begin, begin + size)
__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* table,
                                         int64_t rows, int64_t dim, int64_t begin, int64_t size) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < rows * dim;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = int64_t(tokens[k / dim]) - begin;
    out[k] = row >= 0 && row < size ? table[row * dim + k % dim] : 0.0f;
  }
}

// d_table[tokens[r], i] += d_out[r, i]: one thread per column i, over the
// rows in order, so rows sharing a token add in the CPU twin's order.
__global__ void embedding_backward_kernel(float* d_table, const int32_t* tokens, const float* d_out,
                                          int64_t rows, int64_t dim, int64_t begin, int64_t size) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < dim;
       i += int64_t(gridDim.x) * blockDim.x) {
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t table_row = int64_t(tokens[row]) - begin;
      if (table_row >= 0 && table_row < size) d_table[table_row * dim + i] += d_out[row * dim + i];
    }
  }
}

__device__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

// out = silu(gate) up; d_gate = d_out up silu'(gate), d_up = d_out silu(gate)
__global__ void swiglu_forward_kernel(float* out, const float* gate_up, int64_t rows, int64_t dim) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < rows * dim;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = k / dim, i = k % dim;
    const float gate = gate_up[row * 2 * dim + i], up = gate_up[row * 2 * dim + dim + i];
    out[k] = gate * sigmoid(gate) * up;
  }
}

__global__ void swiglu_backward_kernel(float* d_gate_up, const float* d_out, const float* gate_up,
                                       int64_t rows, int64_t dim) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < rows * dim;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = k / dim, i = k % dim;
    const float gate = gate_up[row * 2 * dim + i], up = gate_up[row * 2 * dim + dim + i];
    const float s = sigmoid(gate);
    d_gate_up[row * 2 * dim + i] = d_out[k] * up * s * (1.0f + gate * (1.0f - s));
    d_gate_up[row * 2 * dim + dim + i] = d_out[k] * gate * s;
  }
}

// y[r, i] += bias[i]
__global__ void bias_forward_kernel(float* y, const float* bias, int64_t rows, int64_t dim) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * dim;
       i += int64_t(gridDim.x) * blockDim.x) {
    y[i] += bias[i % dim];
  }
}

// d_bias[i] += dy[r, i] for r in order, one column per thread: the CPU
// twin's sums, term for term.
__global__ void bias_backward_kernel(float* d_bias, const float* dy, int64_t rows, int64_t dim) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < dim;
       i += int64_t(gridDim.x) * blockDim.x) {
    float sum = d_bias[i];
    for (int64_t row = 0; row < rows; ++row) sum += dy[row * dim + i];
    d_bias[i] = sum;
  }
}

__global__ void add_kernel(float* out, const float* x, const float* delta, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = x[i] + delta[i];
  }
}

__global__ void fill_kernel(float* values, int64_t count, float value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    values[i] = value;
  }
}

__global__ void round_to_bfloat16_kernel(float* values, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    values[i] = __bfloat162float(__float2bfloat16_rn(values[i]));
  }
}

__global__ void to_bfloat16_kernel(uint16_t* bits, const float* values, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    bits[i] = __bfloat16_as_ushort(__float2bfloat16_rn(values[i]));
  }
}

__global__ void from_bfloat16_kernel(float* values, const uint16_t* bits, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    values[i] = __bfloat162float(__ushort_as_bfloat16(bits[i]));
  }
}

// y = x/2 (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3)
__device__ float gelu_argument(float x) {
  return float(kSqrt2OverPi) * (x + 0.044715f * x * x * x);
}

__global__ void gelu_forward_kernel(float* y, const float* x, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = 0.5f * x[i] * (1.0f + tanhf(gelu_argument(x[i])));
  }
}

__global__ void gelu_backward_kernel(float* dx, const float* dy, const float* x, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float t = tanhf(gelu_argument(x[i]));
    const float du = float(kSqrt2OverPi) * (1.0f + float(3 * 0.044715) * x[i] * x[i]);
    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * x[i] * (1.0f - t * t) * du);
  }
}

// z becomes softmax(z); row_loss = log sum exp z - z_target
// A row's maximum, by the whole block.
__device__ float row_maximum(const float* z, int64_t size, float* shared) {
  float top = -INFINITY;
  for (int64_t v = threadIdx.x; v < size; v += kBlock) top = fmaxf(top, z[v]);
  return block_reduce<Max>(top, shared);
}

// z becomes e^(z - top); returns the row's sum of them, by the whole block.
__device__ float exponentiate_row(float* z, int64_t size, float top, float* shared) {
  float sum = 0;
  for (int64_t v = threadIdx.x; v < size; v += kBlock) {
    z[v] = expf(z[v] - top);
    sum += z[v];
  }
  return block_reduce<Sum>(sum, shared);
}

__device__ void scale_row(float* z, int64_t size, float factor) {
  for (int64_t v = threadIdx.x; v < size; v += kBlock) z[v] *= factor;
}

// z = softmax(z); row_loss = log sum e^(z - max) + max - z_target
__global__ void cross_entropy_forward_kernel(float* logits, float* row_loss, const int32_t* targets,
                                             int64_t rows, int64_t vocab) {
  __shared__ float shared[kBlock / kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    float* z = logits + row * vocab;
    const float target_logit = z[targets[row]];
    const float top = row_maximum(z, vocab, shared);
    const float sum = exponentiate_row(z, vocab, top, shared);
    scale_row(z, vocab, 1.0f / sum);
    if (threadIdx.x == 0) row_loss[row] = logf(sum) + top - target_logit;
  }
}

// The vocabulary-parallel forward's three local steps (between them the
// caller all-reduces the maxima, then the sums, over tp).
__global__ void vocab_parallel_max_kernel(float* row_max, const float* logits, int64_t rows,
                                          int64_t size) {
  __shared__ float shared[kBlock / kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float top = row_maximum(logits + row * size, size, shared);
    if (threadIdx.x == 0) row_max[row] = top;
  }
}

__global__ void vocab_parallel_exponentials_kernel(float* logits, float* sums, const float* row_max,
                                                   const int32_t* targets, int64_t rows,
                                                   int64_t begin, int64_t size) {
  __shared__ float shared[kBlock / kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    float* z = logits + row * size;
    const int64_t target = int64_t(targets[row]) - begin;
    const float target_logit = target >= 0 && target < size ? z[target] : 0.0f;
    const float sum = exponentiate_row(z, size, row_max[row], shared);
    if (threadIdx.x == 0) {
      sums[row] = sum;
      sums[rows + row] = target_logit;
    }
  }
}

__global__ void vocab_parallel_probabilities_kernel(float* logits, float* row_loss,
                                                    const float* sums, const float* row_max,
                                                    int64_t rows, int64_t size) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    scale_row(logits + row * size, size, 1.0f / sums[row]);
    if (threadIdx.x == 0) row_loss[row] = logf(sums[row]) + row_max[row] - sums[rows + row];
  }
}

// p = scale (p - [begin + v == target]) / rows over a rank's columns
// [begin, begin + size) (begin 0, size vocab: the whole vocabulary).
__global__ void cross_entropy_backward_kernel(float* probs, const int32_t* targets, int64_t rows,
                                              int64_t begin, int64_t size, float factor) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < rows * size;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = k / size, v = k % size;
    probs[k] = (probs[k] - (begin + v == targets[row] ? 1.0f : 0.0f)) * factor;
  }
}

}  // namespace

cudaError_t rmsnorm_forward(float* y, float* rstd, const float* x, const float* weight,
                            int64_t rows, int64_t dim, double eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  rmsnorm_forward_kernel<<<row_blocks(rows), kBlock, 0, stream>>>(y, rstd, x, weight, rows, dim,
                                                                  float(eps));
  return cudaGetLastError();
}

cudaError_t rmsnorm_backward(float* dx, float* d_weight, const float* dy, const float* x,
                             const float* weight, const float* rstd, int64_t rows, int64_t dim,
                             cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  rmsnorm_input_gradient<<<row_blocks(rows), kBlock, 0, stream>>>(dx, dy, x, weight, rstd, rows,
                                                                  dim);
  norm_weight_gradient<<<element_blocks(dim), kBlock, 0, stream>>>(d_weight, nullptr, dy, x,
                                                                   nullptr, rstd, rows, dim);
  return cudaGetLastError();
}

cudaError_t layernorm_forward(float* y, float* mean, float* rstd, const float* x,
                              const float* weight, const float* bias, int64_t rows, int64_t dim,
                              double eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  layernorm_forward_kernel<<<row_blocks(rows), kBlock, 0, stream>>>(y, mean, rstd, x, weight, bias,
                                                                    rows, dim, float(eps));
  return cudaGetLastError();
}

cudaError_t layernorm_backward(float* dx, float* d_weight, float* d_bias, const float* dy,
                               const float* x, const float* weight, const float* mean,
                               const float* rstd, int64_t rows, int64_t dim, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  layernorm_input_gradient<<<row_blocks(rows), kBlock, 0, stream>>>(dx, dy, x, weight, mean, rstd,
                                                                    rows, dim);
  norm_weight_gradient<<<element_blocks(dim), kBlock, 0, stream>>>(d_weight, d_bias, dy, x, mean,
                                                                   rstd, rows, dim);
  return cudaGetLastError();
}

cudaError_t embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t rows,
                              int64_t dim, int64_t begin, int64_t size, cudaStream_t stream) {
  if (rows * dim == 0) return cudaSuccess;
  embedding_forward_kernel<<<element_blocks(rows * dim), kBlock, 0, stream>>>(
      out, tokens, table, rows, dim, begin, size);
  return cudaGetLastError();
}

cudaError_t embedding_backward(float* d_table, const int32_t* tokens, const float* d_out,
                               int64_t rows, int64_t dim, int64_t begin, int64_t size,
                               cudaStream_t stream) {
  if (rows * dim == 0) return cudaSuccess;
  embedding_backward_kernel<<<element_blocks(dim), kBlock, 0, stream>>>(d_table, tokens, d_out,
                                                                        rows, dim, begin, size);
  return cudaGetLastError();
}

cudaError_t swiglu_forward(float* out, const float* gate_up, int64_t rows, int64_t dim,
                           cudaStream_t stream) {
  if (rows * dim == 0) return cudaSuccess;
  swiglu_forward_kernel<<<element_blocks(rows * dim), kBlock, 0, stream>>>(out, gate_up, rows, dim);
  return cudaGetLastError();
}

cudaError_t swiglu_backward(float* d_gate_up, const float* d_out, const float* gate_up,
                            int64_t rows, int64_t dim, cudaStream_t stream) {
  if (rows * dim == 0) return cudaSuccess;
  swiglu_backward_kernel<<<element_blocks(rows * dim), kBlock, 0, stream>>>(d_gate_up, d_out,
                                                                            gate_up, rows, dim);
  return cudaGetLastError();
}

cudaError_t bias_forward(float* y, const float* bias, int64_t rows, int64_t dim,
                         cudaStream_t stream) {
  if (rows * dim == 0) return cudaSuccess;
  bias_forward_kernel<<<element_blocks(rows * dim), kBlock, 0, stream>>>(y, bias, rows, dim);
  return cudaGetLastError();
}

cudaError_t bias_backward(float* d_bias, const float* dy, int64_t rows, int64_t dim,
                          cudaStream_t stream) {
  if (dim == 0) return cudaSuccess;
  bias_backward_kernel<<<element_blocks(dim), kBlock, 0, stream>>>(d_bias, dy, rows, dim);
  return cudaGetLastError();
}

cudaError_t add(float* out, const float* x, const float* delta, int64_t count,
                cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  add_kernel<<<element_blocks(count), kBlock, 0, stream>>>(out, x, delta, count);
  return cudaGetLastError();
}

cudaError_t fill(float* values, int64_t count, float value, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  fill_kernel<<<element_blocks(count), kBlock, 0, stream>>>(values, count, value);
  return cudaGetLastError();
}

cudaError_t round_to_bfloat16(float* values, int64_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  round_to_bfloat16_kernel<<<element_blocks(count), kBlock, 0, stream>>>(values, count);
  return cudaGetLastError();
}

cudaError_t to_bfloat16(uint16_t* bits, const float* values, int64_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  to_bfloat16_kernel<<<element_blocks(count), kBlock, 0, stream>>>(bits, values, count);
  return cudaGetLastError();
}

cudaError_t from_bfloat16(float* values, const uint16_t* bits, int64_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  from_bfloat16_kernel<<<element_blocks(count), kBlock, 0, stream>>>(values, bits, count);
  return cudaGetLastError();
}

cudaError_t gelu_forward(float* y, const float* x, int64_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  gelu_forward_kernel<<<element_blocks(count), kBlock, 0, stream>>>(y, x, count);
  return cudaGetLastError();
}

cudaError_t gelu_backward(float* dx, const float* dy, const float* x, int64_t count,
                          cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  gelu_backward_kernel<<<element_blocks(count), kBlock, 0, stream>>>(dx, dy, x, count);
  return cudaGetLastError();
}

cudaError_t cross_entropy_forward(float* logits, float* row_loss, const int32_t* targets,
                                  int64_t rows, int64_t vocab, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  cross_entropy_forward_kernel<<<row_blocks(rows), kBlock, 0, stream>>>(logits, row_loss, targets,
                                                                        rows, vocab);
  return cudaGetLastError();
}

cudaError_t cross_entropy_backward(float* probs, const int32_t* targets, int64_t rows,
                                   int64_t vocab, float scale, cudaStream_t stream) {
  return vocab_parallel_cross_entropy_backward(probs, targets, rows, 0, vocab, scale, stream);
}

cudaError_t vocab_parallel_row_max(float* row_max, const float* logits, int64_t rows, int64_t size,
                                   cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  vocab_parallel_max_kernel<<<row_blocks(rows), kBlock, 0, stream>>>(row_max, logits, rows, size);
  return cudaGetLastError();
}

cudaError_t vocab_parallel_exponentials(float* logits, float* sums, const float* row_max,
                                        const int32_t* targets, int64_t rows, int64_t begin,
                                        int64_t size, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  vocab_parallel_exponentials_kernel<<<row_blocks(rows), kBlock, 0, stream>>>(
      logits, sums, row_max, targets, rows, begin, size);
  return cudaGetLastError();
}

cudaError_t vocab_parallel_probabilities(float* logits, float* row_loss, const float* sums,
                                         const float* row_max, int64_t rows, int64_t size,
                                         cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  vocab_parallel_probabilities_kernel<<<row_blocks(rows), kBlock, 0, stream>>>(
      logits, row_loss, sums, row_max, rows, size);
  return cudaGetLastError();
}

cudaError_t vocab_parallel_cross_entropy_backward(float* probs, const int32_t* targets,
                                                  int64_t rows, int64_t begin, int64_t size,
                                                  float scale, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  cross_entropy_backward_kernel<<<element_blocks(rows * size), kBlock, 0, stream>>>(
      probs, targets, rows, begin, size, scale / float(rows));
  return cudaGetLastError();
}

}  // namespace meshrun::kernels::cuda
