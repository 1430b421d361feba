// The CUDA twins of common/layers.hpp's rotary embedding and grouped-query
// causal attention, float32, on device memory, with the CPU twins' layouts:
// a qkv row is [q heads | k heads | v heads], query head h reads kv head
// h / (heads / kv_heads), the forward keeps each row's log-sum-exp
// [batch, heads, seq] and the backward recomputes the probabilities from it.
// Every function enqueues its kernels on `stream` and returns without
// waiting (the DLPack stream convention of common/cuda/layers.hpp).
//
// Attention is flash-style: a block of query rows streams the keys and
// values through shared memory in tiles, keeping a running maximum, sum and
// output per row (online softmax), so no [seq, seq] matrix exists on the
// device. The backward runs one pass over query rows (dQ) and one over key
// rows (dK and dV, summed over the query heads sharing each kv head), so
// every element of d_qkv is written once, without atomics.
//
// These kernels have compiled but never run on a GPU (docs/testing.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace meshrun::kernels::cuda {

// The largest head_dim the attention kernels take (a row's output lives in
// the registers of one warp, four elements a lane).
inline constexpr int64_t kMaxAttentionHeadDim = 128;

struct AttentionDims {
  int64_t batch = 0;
  int64_t seq_len = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
};

// Turns the first `heads` head vectors of every row of x ([batch * seq_len]
// rows, `row_stride` apart, heads `head_dim` apart) by the angles of the
// row's position: cos and sin are device tables [seq_len, half_dim] (the
// CPU RotaryTable's). In place. The backward turns by -angle.
cudaError_t rotary_forward(float* x, const float* cos, const float* sin, int64_t batch,
                           int64_t seq_len, int64_t heads, int64_t head_dim, int64_t half_dim,
                           int64_t row_stride, cudaStream_t stream);
cudaError_t rotary_backward(float* dx, const float* cos, const float* sin, int64_t batch,
                            int64_t seq_len, int64_t heads, int64_t head_dim, int64_t half_dim,
                            int64_t row_stride, cudaStream_t stream);

// out: [batch * seq_len, heads * head_dim]; lse: [batch, heads, seq_len].
// cudaErrorInvalidValue for head_dim outside [1, kMaxAttentionHeadDim] or
// heads not a multiple of kv_heads.
cudaError_t attention_forward(float* out, float* lse, const float* qkv, const AttentionDims& dims,
                              cudaStream_t stream);

// d_qkv (overwritten) from d_out, with the forward's out and lse;
// row_dots is scratch of [batch, heads, seq_len] (D_t = dY_t . Y_t).
cudaError_t attention_backward(float* d_qkv, float* row_dots, const float* d_out, const float* out,
                               const float* qkv, const float* lse, const AttentionDims& dims,
                               cudaStream_t stream);

}  // namespace meshrun::kernels::cuda
