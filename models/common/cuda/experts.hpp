// The CUDA twins of the token movement of common/mixture_of_experts.hpp (a
// sparse mixture of experts, Mixtral's): routing each row to its top_k
// experts, ordering the row copies ("slots") by expert, dispatching rows
// into that order and combining the experts' outputs back, with their
// backwards. The experts' GEMMs run on the dispatched rows (numeric/cuda/
// gemm.hpp), the all-to-alls between ranks on the comm backend. Device
// pointers; N rows of width H, E experts, K = top_k, slot n K + k is row
// n's k-th choice. Every call is enqueued on `stream`.
//
// This code has compiled but never run on a GPU (docs/testing.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace meshrun::kernels::cuda {

// values [rows, columns] = the softmax of each row, in place; its backward
// d = p (d - p . d), in place of the gradient. One thread per row.
cudaError_t softmax_rows(float* values, int64_t rows, int64_t columns, cudaStream_t stream);
cudaError_t softmax_rows_backward(float* d_values, const float* probs, int64_t rows,
                                  int64_t columns, cudaStream_t stream);

// sums[e] = the sum over rows of values[n, e], in double, in row order (the
// load-balancing loss's mean router probabilities).
cudaError_t column_sums(double* sums, const float* values, int64_t rows, int64_t columns,
                        cudaStream_t stream);

// The router probabilities' gradient d_probs [N, E] from the routing
// weights' gradients d_weights and the load-balancing loss's per-token
// gradient aux_per_token [E] (common/experts.hpp, moe_router_gradient).
cudaError_t moe_router_gradient(float* d_probs, const float* aux_per_token, const float* probs,
                                const int32_t* selected, const float* weights,
                                const float* d_weights, int64_t rows, int64_t experts,
                                int64_t top_k, cudaStream_t stream);

// selected[n K + k] = row n's k-th expert by probability (probs [N, E], a
// softmax; strictly greater wins, so ties go to the lower expert), and
// weights[n K + k] its probability over the sum of the K chosen.
cudaError_t moe_route(int32_t* selected, float* weights, const float* probs, int64_t rows,
                      int64_t experts, int64_t top_k, cudaStream_t stream);

// tokens_per_expert[e] = the slots choosing e; slot_position[slot] = the
// slot's place in dispatch order: grouped by expert, slots in order within
// an expert (the CPU's order, so both move the same rows to the same
// places). One block; experts <= 1024.
cudaError_t moe_order_slots(int64_t* tokens_per_expert, int64_t* slot_position,
                            const int32_t* selected, int64_t rows, int64_t experts, int64_t top_k,
                            cudaStream_t stream);

// slots[slot_position[s]] = x[s / K] (rows of H).
cudaError_t moe_dispatch(float* slots, const float* x, const int64_t* slot_position, int64_t rows,
                         int64_t top_k, int64_t hidden, cudaStream_t stream);

// y[n] = sum_k weights[n K + k] expert_outputs[slot_position[n K + k]],
// added in k order (overwrites y).
cudaError_t moe_combine(float* y, const float* expert_outputs, const float* weights,
                        const int64_t* slot_position, int64_t rows, int64_t top_k, int64_t hidden,
                        cudaStream_t stream);

// Combine's backward: d_slots[slot_position[s]] = weights[s] dy[s / K] and
// d_weights[s] = dy[s / K] . expert_outputs[slot_position[s]].
cudaError_t moe_combine_backward(float* d_slots, float* d_weights, const float* dy,
                                 const float* expert_outputs, const float* weights,
                                 const int64_t* slot_position, int64_t rows, int64_t top_k,
                                 int64_t hidden, cudaStream_t stream);

// Dispatch's backward: dx[n] = sum_k d_slots[slot_position[n K + k]], in k
// order (overwrites dx).
cudaError_t moe_dispatch_backward(float* dx, const float* d_slots, const int64_t* slot_position,
                                  int64_t rows, int64_t top_k, int64_t hidden, cudaStream_t stream);

}  // namespace meshrun::kernels::cuda
