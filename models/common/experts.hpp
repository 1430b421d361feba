// The CPU kernels of a sparse mixture of experts (common/
// mixture_of_experts.hpp composes them with the experts' GEMMs and the
// all-to-alls over ep): the router's softmax, routing each row to its top_k
// experts, ordering the row copies ("slots") by expert, dispatching rows
// into that order and combining the experts' outputs back, with their
// backwards, and what the load-balancing loss needs. N rows of width H, E
// experts, K = top_k, slot n K + k is row n's k-th choice. The CUDA twins
// are common/cuda/experts.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/expert_rows.hpp"

namespace meshrun::kernels {

// values [rows, columns] = the softmax of each row, in place; and its
// backward d = p (d - p . d), in place of the gradient.
inline void softmax_rows(float* values, int64_t rows, int64_t columns) {
  for (int64_t n = 0; n < rows; ++n) {
    float* row = values + n * columns;
    const float top = *std::max_element(row, row + columns);
    float sum = 0;
    for (int64_t e = 0; e < columns; ++e) sum += row[e] = std::exp(row[e] - top);
    for (int64_t e = 0; e < columns; ++e) row[e] /= sum;
  }
}

inline void softmax_rows_backward(float* d_values, const float* probs, int64_t rows,
                                  int64_t columns) {
  for (int64_t n = 0; n < rows; ++n) {
    float* d = d_values + n * columns;
    const float* p = probs + n * columns;
    float dot = 0;
    for (int64_t e = 0; e < columns; ++e) dot += d[e] * p[e];
    for (int64_t e = 0; e < columns; ++e) d[e] = p[e] * (d[e] - dot);
  }
}

// selected[n K + k] = row n's k-th expert by probability (strictly greater
// wins, so ties go to the lower expert on every rank alike), weights[n K +
// k] its probability over the sum of the K chosen.
inline void moe_route(int32_t* selected, float* weights, const float* probs, int64_t rows,
                      int64_t experts, int64_t top_k) {
  for (int64_t n = 0; n < rows; ++n) {
    const float* p = probs + n * experts;
    int32_t* picked = selected + n * top_k;
    float sum = 0;
    for (int64_t k = 0; k < top_k; ++k) {
      int32_t best = -1;
      for (int32_t e = 0; e < experts; ++e) {
        if (std::find(picked, picked + k, e) != picked + k) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      picked[k] = best;
      sum += p[best];
    }
    for (int64_t k = 0; k < top_k; ++k) weights[n * top_k + k] = p[picked[k]] / sum;
  }
}

// tokens_per_expert[e] = the slots choosing e; slot_position[slot] = the
// slot's place in dispatch order: grouped by expert, slots in order within
// an expert.
inline void moe_order_slots(int64_t* tokens_per_expert, int64_t* slot_position,
                            const int32_t* selected, int64_t rows, int64_t experts, int64_t top_k) {
  std::fill_n(tokens_per_expert, experts, 0);
  for (int64_t slot = 0; slot < rows * top_k; ++slot) ++tokens_per_expert[selected[slot]];
  std::vector<int64_t> next(size_t(experts), 0);
  for (int64_t e = 1; e < experts; ++e)
    next[size_t(e)] = next[size_t(e - 1)] + tokens_per_expert[e - 1];
  for (int64_t slot = 0; slot < rows * top_k; ++slot) {
    slot_position[slot] = next[size_t(selected[slot])]++;
  }
}

// slots[slot_position[s]] = x[s / K] (rows of H).
inline void moe_dispatch(float* slots, const float* x, const int64_t* slot_position, int64_t rows,
                         int64_t top_k, int64_t hidden) {
  for (int64_t slot = 0; slot < rows * top_k; ++slot) {
    std::copy_n(x + (slot / top_k) * hidden, hidden, slots + slot_position[slot] * hidden);
  }
}

// y[n] = sum_k weights[n K + k] expert_outputs[slot_position[n K + k]],
// added in k order (overwrites y).
inline void moe_combine(float* y, const float* expert_outputs, const float* weights,
                        const int64_t* slot_position, int64_t rows, int64_t top_k, int64_t hidden) {
  std::fill_n(y, rows * hidden, 0.0f);
  for (int64_t slot = 0; slot < rows * top_k; ++slot) {
    const float w = weights[slot];
    const float* expert_y = expert_outputs + slot_position[slot] * hidden;
    float* row = y + (slot / top_k) * hidden;
    for (int64_t i = 0; i < hidden; ++i) row[i] += w * expert_y[i];
  }
}

// Combine's backward: d_slots[slot_position[s]] = weights[s] dy[s / K] and
// d_weights[s] = dy[s / K] . expert_outputs[slot_position[s]].
inline void moe_combine_backward(float* d_slots, float* d_weights, const float* dy,
                                 const float* expert_outputs, const float* weights,
                                 const int64_t* slot_position, int64_t rows, int64_t top_k,
                                 int64_t hidden) {
  for (int64_t slot = 0; slot < rows * top_k; ++slot) {
    const int64_t at = slot_position[slot] * hidden;
    const float* d_row = dy + (slot / top_k) * hidden;
    const float* expert_y = expert_outputs + at;
    const float w = weights[slot];
    float dot = 0;
    for (int64_t i = 0; i < hidden; ++i) {
      d_slots[at + i] = w * d_row[i];
      dot += d_row[i] * expert_y[i];
    }
    d_weights[slot] = dot;
  }
}

// Dispatch's backward: dx[n] = sum_k d_slots[slot_position[n K + k]], in k
// order (overwrites dx).
inline void moe_dispatch_backward(float* dx, const float* d_slots, const int64_t* slot_position,
                                  int64_t rows, int64_t top_k, int64_t hidden) {
  std::fill_n(dx, rows * hidden, 0.0f);
  for (int64_t slot = 0; slot < rows * top_k; ++slot) {
    const float* d_slot = d_slots + slot_position[slot] * hidden;
    float* row = dx + (slot / top_k) * hidden;
    for (int64_t i = 0; i < hidden; ++i) row[i] += d_slot[i];
  }
}

// sums[e] = the sum over rows of values[n, e], in double, in row order.
inline void column_sums(double* sums, const float* values, int64_t rows, int64_t columns) {
  for (int64_t e = 0; e < columns; ++e) sums[e] = column_sum(values, rows, columns, e);
}

// The gradient of the router's probabilities, d_probs [N, E]: from the
// routing weights' gradients d_weights (w_k = p_k / sum_S p), dp_m = (dw_m
// - sum_k dw_k w_k) / sum_S p for the selected m; plus the load-balancing
// loss's, aux_per_token[e] for every row (its scale times expert e's
// tokens, the counts taken as constants as Hugging Face's loss does).
inline void moe_router_gradient(float* d_probs, const float* aux_per_token, const float* probs,
                                const int32_t* selected, const float* weights,
                                const float* d_weights, int64_t rows, int64_t experts,
                                int64_t top_k) {
  for (int64_t n = 0; n < rows; ++n) {
    router_gradient_row(d_probs + n * experts, aux_per_token, probs + n * experts,
                        selected + n * top_k, weights + n * top_k, d_weights + n * top_k, experts,
                        top_k);
  }
}

}  // namespace meshrun::kernels
