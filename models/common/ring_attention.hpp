// The steps of ring attention (common/context_parallel.hpp) on the host:
// one key/value block's part of causal attention for a rank's query rows,
// merged into a running softmax (forward) or added into the gradients
// (backward), like flash attention's inner loop with the block's keys from
// another rank. The CUDA twins (common/cuda/attention.hpp) take the same
// operands; common/compute.hpp's ring_attention_* calls reach either.
//
// Layouts, for the gathered shape g (AttentionShape, T = g.seq_len rows a
// sequence): qkv [batch * T, qkv_dim] and out [batch * T, q_dim] as
// common/layers.hpp's attention; a key/value block kv [batch * T,
// 2 kv_dim] (its k heads, then its v heads); the running maximum and sum
// and the log-sum-exps [batch, heads, T].
#pragma once

#include <cstdint>
#include <vector>

#include "common/layers.hpp"

namespace meshrun::kernels {

// Where the rows of the queries and of a key/value block lie in their
// sequence: runs of `chunk` rows, run i being the sequence's chunk
// query_chunks[i] (key_chunks[i]), so row t sits at position
// chunks[t / chunk] * chunk + t % chunk. A query sees a key at or before
// its position.
struct RingBlock {
  int64_t chunk = 0;
  std::vector<int64_t> query_chunks, key_chunks;
};

// Floats of scratch ring_merge and ring_block_backward take.
int64_t ring_scratch_size(const AttentionShape& g, int64_t chunk);

// Online softmax over blocks, per query row t and head: with the running
// maximum m and sum l of exp(S - m), the block's scores S' (= Q K'^T /
// sqrt(d), the visible keys only) give
//   m' = max(m, max S'),  l' = l e^(m - m') + sum exp(S' - m'),
//   acc' = acc e^(m - m') + exp(S' - m') V'
// acc [batch * T, q_dim], row_max and row_sum updated in place (before the
// first block: acc 0, m a large negative finite value, l 0).
void ring_merge(const AttentionShape& g, const RingBlock& block, float* acc, float* row_max,
                float* row_sum, const float* qkv, const float* kv, float* scratch);

// The end of the forward: out = acc / l in place, lse = m + log l.
void ring_finish(const AttentionShape& g, float* out, float* lse, const float* row_max,
                 const float* row_sum);

// D_t = rowsum(dO_t * O_t) per row and head, into dots [batch, heads, T].
void ring_output_dots(const AttentionShape& g, float* dots, const float* out, const float* d_out);

// One block's part of flash attention's backward, P recomputed from the
// final log-sum-exp L and D from ring_output_dots:
//   dV += P^T dO;  dS = P * (dO V^T - D);  dQ += dS K / sqrt(d);
//   dK += dS^T Q / sqrt(d)
// dQ added into d_qkv's q columns, dK and dV into d_kv [batch * T,
// 2 kv_dim].
void ring_block_backward(const AttentionShape& g, const RingBlock& block, float* d_qkv, float* d_kv,
                         const float* qkv, const float* kv, const float* d_out, const float* lse,
                         const float* dots, float* scratch);

}  // namespace meshrun::kernels
