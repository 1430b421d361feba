// The CUDA twins of common/layers.hpp's embedding and element-wise layers, float32, on
// device memory: the first pieces of the model kit's device variant. Each
// computes what its CPU twin computes (the same math, the same
// accumulate-into conventions), which is its oracle in
// tests/gpu/test_cuda_layers.cpp. Every function enqueues its kernels on
// `stream` and returns without waiting; the caller orders the buffers'
// other users after them (the DLPack stream convention). Pointers are
// device pointers; sizes are counts of elements. Errors of the launch come
// back as cudaError_t.
//
// These kernels have compiled but never run on a GPU (docs/testing.md):
// no machine with a GPU has been lent to the sessions that wrote them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace meshrun::kernels::cuda {

// Over the table's rows [begin, begin + size) of the vocabulary (a
// vocabulary-parallel rank's shard; 0 and the vocabulary for all of it):
// out[r, :] = table[tokens[r] - begin, :], zero for a token outside; and
// d_table[tokens[r] - begin, :] += d_out[r, :] for the tokens inside, rows
// sharing a token added in row order (as the CPU twin adds them).
cudaError_t embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t rows,
                              int64_t dim, int64_t begin, int64_t size, cudaStream_t stream);
cudaError_t embedding_backward(float* d_table, const int32_t* tokens, const float* d_out,
                               int64_t rows, int64_t dim, int64_t begin, int64_t size,
                               cudaStream_t stream);

// RMSNorm per row: y = x r w, r = (mean x^2 + eps)^(-1/2), rstd[row] = r.
cudaError_t rmsnorm_forward(float* y, float* rstd, const float* x, const float* weight,
                            int64_t rows, int64_t dim, double eps, cudaStream_t stream);
// dx += through the norm; d_weight += sum over rows of dy x r.
cudaError_t rmsnorm_backward(float* dx, float* d_weight, const float* dy, const float* x,
                             const float* weight, const float* rstd, int64_t rows, int64_t dim,
                             cudaStream_t stream);

// LayerNorm per row: y = (x - m) r w + b; mean[row] = m, rstd[row] = r.
cudaError_t layernorm_forward(float* y, float* mean, float* rstd, const float* x,
                              const float* weight, const float* bias, int64_t rows, int64_t dim,
                              double eps, cudaStream_t stream);
// dx += through the norm; d_weight += sum dy n, d_bias += sum dy.
cudaError_t layernorm_backward(float* dx, float* d_weight, float* d_bias, const float* dy,
                               const float* x, const float* weight, const float* mean,
                               const float* rstd, int64_t rows, int64_t dim, cudaStream_t stream);

// y[r, :] += bias; d_bias += the sum of dy's rows, added in row order (as
// the CPU twin adds them).
cudaError_t bias_forward(float* y, const float* bias, int64_t rows, int64_t dim,
                         cudaStream_t stream);
cudaError_t bias_backward(float* d_bias, const float* dy, int64_t rows, int64_t dim,
                          cudaStream_t stream);

// out = x + delta (out may be x or delta: a residual connection, or a sum
// accumulated in place).
cudaError_t add(float* out, const float* x, const float* delta, int64_t count, cudaStream_t stream);

// values[i] = value.
cudaError_t fill(float* values, int64_t count, float value, cudaStream_t stream);

// Each value rounded to bfloat16 (nearest even), in place, as
// numeric/bfloat16.hpp's round_to_bfloat16.
cudaError_t round_to_bfloat16(float* values, int64_t count, cudaStream_t stream);
// The bfloat16 bits of each value (nearest even), and their widening back:
// numeric/bfloat16.hpp's to_bfloat16 and from_bfloat16.
cudaError_t to_bfloat16(uint16_t* bits, const float* values, int64_t count, cudaStream_t stream);
cudaError_t from_bfloat16(float* values, const uint16_t* bits, int64_t count, cudaStream_t stream);

// out = silu(gate) * up over rows of [gate | up]; and its gradients.
cudaError_t swiglu_forward(float* out, const float* gate_up, int64_t rows, int64_t dim,
                           cudaStream_t stream);
cudaError_t swiglu_backward(float* d_gate_up, const float* d_out, const float* gate_up,
                            int64_t rows, int64_t dim, cudaStream_t stream);

// GPT-2's tanh GELU and its gradient (dx may be dy).
cudaError_t gelu_forward(float* y, const float* x, int64_t count, cudaStream_t stream);
cudaError_t gelu_backward(float* dx, const float* dy, const float* x, int64_t count,
                          cudaStream_t stream);

// Per row: logits become their softmax, row_loss[row] = log sum exp z -
// z_target (the caller averages). And the gradient of scale x the mean:
// probs become scale (p - onehot) / rows.
cudaError_t cross_entropy_forward(float* logits, float* row_loss, const int32_t* targets,
                                  int64_t rows, int64_t vocab, cudaStream_t stream);
cudaError_t cross_entropy_backward(float* probs, const int32_t* targets, int64_t rows,
                                   int64_t vocab, float scale, cudaStream_t stream);

// Vocabulary-parallel cross-entropy (common/tensor_parallel.hpp): the local
// steps of a tp rank holding vocabulary columns [begin, begin + size) of
// `rows` rows of logits. Between them the caller all-reduces over tp: the
// maxima (max), then the sums (sum, 2 rows floats). Forward:
//   1. row_max[r] = the maximum of the rank's logits of row r;
//   2. the logits become e^(z - row_max); sums[r] = their sum,
//      sums[rows + r] = the target's logit where the rank holds it, else 0;
//   3. the logits become probabilities (divided by the summed sums[r]);
//      row_loss[r] = log sum + max - target logit (the caller averages).
cudaError_t vocab_parallel_row_max(float* row_max, const float* logits, int64_t rows, int64_t size,
                                   cudaStream_t stream);
cudaError_t vocab_parallel_exponentials(float* logits, float* sums, const float* row_max,
                                        const int32_t* targets, int64_t rows, int64_t begin,
                                        int64_t size, cudaStream_t stream);
cudaError_t vocab_parallel_probabilities(float* logits, float* row_loss, const float* sums,
                                         const float* row_max, int64_t rows, int64_t size,
                                         cudaStream_t stream);
// Backward on the rank's columns: probs become scale (p - onehot) / rows.
cudaError_t vocab_parallel_cross_entropy_backward(float* probs, const int32_t* targets,
                                                  int64_t rows, int64_t begin, int64_t size,
                                                  float scale, cudaStream_t stream);

}  // namespace meshrun::kernels::cuda
