#include "common/ring_attention.hpp"

#include <algorithm>
#include <cmath>

namespace meshrun::kernels {

namespace {

// Where one query head's rows and its key/value head's rows lie: gathered
// qkv rows [T, qkv_dim] and a key/value block [T, 2 kv_dim] (k, then v).
template <class Real>
struct HeadRows {
  Real* q;
  Real* k;
  Real* v;
  int64_t ld_q, ld_kv;
};

template <class Real>
HeadRows<Real> head_rows(Real* qkv, Real* kv, const AttentionShape& g, int64_t b, int64_t h) {
  const int64_t T = g.seq_len, kv_head = h / (g.heads / g.kv_heads);
  Real* k = kv + b * T * 2 * g.kv_dim() + kv_head * g.head_dim;
  return {qkv + b * T * g.qkv_dim() + g.q_offset(h), k, k + g.kv_dim(), g.qkv_dim(),
          2 * g.kv_dim()};
}

// Which keys a block of queries sees: all of a chunk before its own, the
// causal triangle of its own, none of a later one.
enum class Visibility { all, causal, none };
Visibility visibility(int64_t query_chunk, int64_t key_chunk) {
  if (key_chunk < query_chunk) return Visibility::all;
  return key_chunk == query_chunk ? Visibility::causal : Visibility::none;
}

// Query rows [t0, t0 + rows) against keys [s0, s0 + width) of a block; when
// causal, row t0 + i sees the keys up to s0 + width - rows + i only.
struct VisibleBlock {
  int64_t t0, s0, rows, width;
  bool causal;
  int64_t seen(int64_t i) const { return causal ? width - rows + i + 1 : width; }
};

// Calls f(VisibleBlock) for each run of at most query_block query rows
// against the visible keys of each chunk pair.
template <class F>
void for_visible_blocks(const std::vector<int64_t>& query_chunks,
                        const std::vector<int64_t>& key_chunks, int64_t chunk, int64_t query_block,
                        F&& f) {
  for (size_t qs = 0; qs < query_chunks.size(); ++qs) {
    for (size_t ks = 0; ks < key_chunks.size(); ++ks) {
      const Visibility seen = visibility(query_chunks[qs], key_chunks[ks]);
      if (seen == Visibility::none) continue;
      for (int64_t r0 = 0; r0 < chunk; r0 += query_block) {
        const int64_t rows = std::min(query_block, chunk - r0);
        const bool causal = seen == Visibility::causal;
        f(VisibleBlock{int64_t(qs) * chunk + r0, int64_t(ks) * chunk, rows,
                       causal ? r0 + rows : chunk, causal});
      }
    }
  }
}

// The online softmax of one query head's rows: the running sum of P V
// (acc, rows ld_acc apart), the running maximum and sum of exp(S - max).
struct RunningSoftmax {
  float* acc;
  int64_t ld_acc;
  float* max;
  float* sum;
};

// Merges one block's keys into the running softmax; scores is scratch of
// rows x width.
void merge_block(const HeadRows<const float>& head, const RunningSoftmax& state,
                 const VisibleBlock& block, int64_t d, float* scores) {
  const float scale = 1.0f / std::sqrt(float(d));
  const int64_t t0 = block.t0, width = block.width;
  gemm(false, true, block.rows, width, d, scale, head.q + t0 * head.ld_q, head.ld_q,
       head.k + block.s0 * head.ld_kv, head.ld_kv, 0.0f, scores, width);
  for (int64_t i = 0; i < block.rows; ++i) {
    float* row = scores + i * width;
    const int64_t seen = block.seen(i);
    const float max = std::max(state.max[t0 + i], *std::max_element(row, row + seen));
    const float alpha = std::exp(state.max[t0 + i] - max);
    float sum = 0.0f;
    for (int64_t s = 0; s < seen; ++s) {
      row[s] = std::exp(row[s] - max);
      sum += row[s];
    }
    std::fill(row + seen, row + width, 0.0f);
    state.sum[t0 + i] = state.sum[t0 + i] * alpha + sum;
    state.max[t0 + i] = max;
    float* acc_row = state.acc + (t0 + i) * state.ld_acc;
    for (int64_t e = 0; e < d; ++e) acc_row[e] *= alpha;
  }
  gemm(false, false, block.rows, d, width, 1.0f, scores, width, head.v + block.s0 * head.ld_kv,
       head.ld_kv, 1.0f, state.acc + t0 * state.ld_acc, state.ld_acc);
}

// What one query head's backward reads besides the keys and values: the
// output's gradient (rows ld_out apart), the rows' log-sum-exps L and
// D = rowsum(dO * O).
struct HeadBackward {
  const float* d_out;
  int64_t ld_out;
  const float* lse;
  const float* dots;
};

// One block's part of dQ (into grad.q) and of the block's dK, dV (into
// grad.k, grad.v); p and ds are scratch of rows x width.
void block_backward(const HeadRows<const float>& head, const HeadRows<float>& grad,
                    const HeadBackward& upstream, const VisibleBlock& block, int64_t d, float* p,
                    float* ds) {
  const float scale = 1.0f / std::sqrt(float(d));
  const int64_t t0 = block.t0, s0 = block.s0, rows = block.rows, width = block.width;
  const float* dy = upstream.d_out + t0 * upstream.ld_out;
  gemm(false, true, rows, width, d, scale, head.q + t0 * head.ld_q, head.ld_q,
       head.k + s0 * head.ld_kv, head.ld_kv, 0.0f, p, width);
  gemm(false, true, rows, width, d, 1.0f, dy, upstream.ld_out, head.v + s0 * head.ld_kv, head.ld_kv,
       0.0f, ds, width);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t seen = block.seen(i);
    float* p_row = p + i * width;
    float* ds_row = ds + i * width;
    for (int64_t s = 0; s < seen; ++s) {
      p_row[s] = std::exp(p_row[s] - upstream.lse[t0 + i]);
      ds_row[s] = p_row[s] * (ds_row[s] - upstream.dots[t0 + i]);
    }
    std::fill(p_row + seen, p_row + width, 0.0f);
    std::fill(ds_row + seen, ds_row + width, 0.0f);
  }
  gemm(true, false, width, d, rows, 1.0f, p, width, dy, upstream.ld_out, 1.0f,
       grad.v + s0 * grad.ld_kv, grad.ld_kv);
  gemm(false, false, rows, d, width, scale, ds, width, head.k + s0 * head.ld_kv, head.ld_kv, 1.0f,
       grad.q + t0 * grad.ld_q, grad.ld_q);
  gemm(true, false, width, d, rows, scale, ds, width, head.q + t0 * head.ld_q, head.ld_q, 1.0f,
       grad.k + s0 * grad.ld_kv, grad.ld_kv);
}

// Calls f(b, h, stats, column) for each sequence b and query head h:
// stats is where its rows start in the per-row statistics [batch, heads,
// T], column where its first row's elements start in rows of q_dim.
template <class F>
void for_each_head(const AttentionShape& g, F&& f) {
  for (int64_t b = 0; b < g.batch; ++b) {
    for (int64_t h = 0; h < g.heads; ++h) {
      f(b, h, (b * g.heads + h) * g.seq_len, b * g.seq_len * g.q_dim() + h * g.head_dim);
    }
  }
}

}  // namespace

int64_t ring_scratch_size(const AttentionShape& g, int64_t chunk) {
  return 2 * std::min(g.query_block, chunk) * chunk;
}

void ring_merge(const AttentionShape& g, const RingBlock& block, float* acc, float* row_max,
                float* row_sum, const float* qkv, const float* kv, float* scratch) {
  for_each_head(g, [&](int64_t b, int64_t h, int64_t stats, int64_t column) {
    const HeadRows<const float> head = head_rows<const float>(qkv, kv, g, b, h);
    const RunningSoftmax state{acc + column, g.q_dim(), row_max + stats, row_sum + stats};
    for_visible_blocks(block.query_chunks, block.key_chunks, block.chunk, g.query_block,
                       [&](const VisibleBlock& visible) {
                         merge_block(head, state, visible, g.head_dim, scratch);
                       });
  });
}

void ring_finish(const AttentionShape& g, float* out, float* lse, const float* row_max,
                 const float* row_sum) {
  for_each_head(g, [&](int64_t /*b*/, int64_t /*h*/, int64_t stats, int64_t column) {
    for (int64_t t = 0; t < g.seq_len; ++t) {
      float* acc_row = out + column + t * g.q_dim();
      const float inv = 1.0f / row_sum[stats + t];
      for (int64_t e = 0; e < g.head_dim; ++e) acc_row[e] *= inv;
      lse[stats + t] = row_max[stats + t] + std::log(row_sum[stats + t]);
    }
  });
}

void ring_output_dots(const AttentionShape& g, float* dots, const float* out, const float* d_out) {
  for_each_head(g, [&](int64_t /*b*/, int64_t /*h*/, int64_t stats, int64_t column) {
    for (int64_t t = 0; t < g.seq_len; ++t) {
      const float* dy = d_out + column + t * g.q_dim();
      const float* y = out + column + t * g.q_dim();
      float dot = 0.0f;
      for (int64_t e = 0; e < g.head_dim; ++e) dot += dy[e] * y[e];
      dots[stats + t] = dot;
    }
  });
}

void ring_block_backward(const AttentionShape& g, const RingBlock& block, float* d_qkv, float* d_kv,
                         const float* qkv, const float* kv, const float* d_out, const float* lse,
                         const float* dots, float* scratch) {
  float* ds = scratch + ring_scratch_size(g, block.chunk) / 2;
  for_each_head(g, [&](int64_t b, int64_t h, int64_t stats, int64_t column) {
    const HeadRows<const float> head = head_rows<const float>(qkv, kv, g, b, h);
    const HeadRows<float> grad = head_rows<float>(d_qkv, d_kv, g, b, h);
    const HeadBackward upstream{d_out + column, g.q_dim(), lse + stats, dots + stats};
    for_visible_blocks(block.query_chunks, block.key_chunks, block.chunk, g.query_block,
                       [&](const VisibleBlock& visible) {
                         block_backward(head, grad, upstream, visible, g.head_dim, scratch, ds);
                       });
  });
}

}  // namespace meshrun::kernels
