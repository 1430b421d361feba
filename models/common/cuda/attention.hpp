// The CUDA twins of common/layers.hpp's rotary embedding and grouped-query
// causal attention, float32, on device memory, with the CPU twins' layouts:
// a qkv row is [q heads | k heads | v heads], query head h reads kv head
// h / (heads / kv_heads), the forward keeps each row's log-sum-exp
// [batch, heads, seq] and the backward recomputes the probabilities from it.
// Every function enqueues its kernels on `stream` and returns without
// waiting (the DLPack stream convention of common/cuda/layers.hpp).
//
// Attention is flash-style (ring attention's steps over cp ranks too): a block of query rows
// streams the keys and values through shared memory in tiles, keeping a running maximum, sum and
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

// The most chunks a side of a ring attention step spans (2 x the Ulysses
// degree).
inline constexpr int kMaxRingChunks = 64;

// Where a ring attention step's query rows and key/value block rows lie in
// their sequence (common/ring_attention.hpp's RingBlock, by value for the
// kernels): runs of `chunk` rows, run i being chunk query[i] (key[i]) of
// the sequence; `count` runs a side, count * chunk = seq_len.
struct RingChunks {
  int64_t chunk = 0;
  int32_t count = 0;
  int32_t query[kMaxRingChunks] = {};
  int32_t key[kMaxRingChunks] = {};
};

// Ring attention's steps (common/ring_attention.hpp's ring_merge,
// ring_finish, ring_output_dots, ring_block_backward: the same layouts and
// math), dims the gathered shape: a key/value block kv [batch * seq_len,
// 2 kv_dim] merged into the running acc, row_max and row_sum; out = acc /
// row_sum in place and lse; the row dots; the block's part of dQ added into
// d_qkv's query columns and of dK, dV into d_kv. Tiles of keys no query of
// a block of rows sees are skipped. cudaErrorInvalidValue as
// attention_forward's, or for chunks that do not tile seq_len or are more
// than kMaxRingChunks.
cudaError_t ring_attention_merge(float* acc, float* row_max, float* row_sum, const float* qkv,
                                 const float* kv, const AttentionDims& dims,
                                 const RingChunks& chunks, cudaStream_t stream);
cudaError_t ring_attention_finish(float* out, float* lse, const float* row_max,
                                  const float* row_sum, const AttentionDims& dims,
                                  cudaStream_t stream);
cudaError_t ring_attention_output_dots(float* dots, const float* out, const float* d_out,
                                       const AttentionDims& dims, cudaStream_t stream);
cudaError_t ring_attention_block_backward(float* d_qkv, float* d_kv, const float* qkv,
                                          const float* kv, const float* d_out, const float* lse,
                                          const float* dots, const AttentionDims& dims,
                                          const RingChunks& chunks, cudaStream_t stream);

}  // namespace meshrun::kernels::cuda
