// The layers of the shipped transformer models (Llama, GPT-2) as plain
// kernels, in the style of llm.c: the forward and the backward of each layer
// side by side, each with its math, written as loops or one BLAS call.
// Templated on the real type so the models run them in float and the tests
// check every backward against finite differences of its forward in double.
//
// Conventions. Matrices are row-major. Activations hold one row per token:
// N = batch * seq_len rows, token (b, t) in row b * seq_len + t. Weights have
// Hugging Face's shape [out, in]. Backward kernels take the upstream
// gradient dL/dy and accumulate (+=) into parameter gradients; activation
// gradients are overwritten unless the comment says they accumulate.
// GPT-2's Conv1D stores its weight transposed, [in, out].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "numeric/bfloat16.hpp"
#include "numeric/gemm.hpp"

namespace meshrun::kernels {

// ---------------------------------------------------------------------------
// Embedding: out[r, :] = table[tokens[r], :]. The table may be the rows
// [begin, begin + size) of the vocabulary (a vocabulary-parallel rank's
// shard): a token outside gets a zero row forward and adds nothing
// backward. By default the table is all of it.

inline constexpr int64_t kWholeTable = std::numeric_limits<int64_t>::max();

template <typename Real>
void embedding_forward(Real* out, const int32_t* tokens, const Real* table, int64_t rows,
                       int64_t dim, int64_t begin = 0, int64_t size = kWholeTable) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t table_row = tokens[r] - begin;
    if (table_row >= 0 && table_row < size) {
      std::copy_n(table + table_row * dim, dim, out + r * dim);
    } else {
      std::fill_n(out + r * dim, dim, Real(0));
    }
  }
}

// d_table[tokens[r] - begin, :] += d_out[r, :] for the tokens the table holds
template <typename Real>
void embedding_backward(Real* d_table, const int32_t* tokens, const Real* d_out, int64_t rows,
                        int64_t dim, int64_t begin = 0, int64_t size = kWholeTable) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t table_row = tokens[r] - begin;
    if (table_row < 0 || table_row >= size) continue;
    Real* d_row = d_table + table_row * dim;
    for (int64_t i = 0; i < dim; ++i) d_row[i] += d_out[r * dim + i];
  }
}

// ---------------------------------------------------------------------------
// A weight as the linears' GEMMs read it: `data`, and where the host holds
// one, `bfloat16`: the same numbers in bfloat16 (a strategy that gathers in
// bfloat16 keeps what it received), which a bfloat16 matmul reads instead of
// rounding `data` again. A bare pointer makes one without.

template <typename Real>
struct Weight {
  Weight(const Real* data) : data(data) {}  // NOLINT(google-explicit-constructor)
  Weight(const Real* data, const uint16_t* bfloat16) : data(data), bfloat16(bfloat16) {}
  const Real* data;
  const uint16_t* bfloat16 = nullptr;
};

// C = alpha op(A) op(W) + beta C, the weight read in bfloat16 where a
// bfloat16 matmul can (the products are the same either way).
template <typename Real>
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, Real alpha,
          const Real* a, int64_t lda, const Weight<Real>& b, int64_t ldb, Real beta, Real* c,
          int64_t ldc) {
  if constexpr (std::is_same_v<Real, float>) {
    if (b.bfloat16 != nullptr && matmul_precision() == MatmulPrecision::bfloat16 &&
        bfloat16_matmuls_native()) {
      gemm(transpose_a, transpose_b, m, n, k, alpha, GemmOperand{a, nullptr, lda},
           GemmOperand{nullptr, b.bfloat16, ldb}, beta, c, ldc);
      return;
    }
  }
  gemm(transpose_a, transpose_b, m, n, k, alpha, a, lda, b.data, ldb, beta, c, ldc);
}

// ---------------------------------------------------------------------------
// Linear without bias: y[N, out] = x[N, in] W[out, in]^T

template <typename Real>
void linear_forward(Real* y, const Real* x, std::type_identity_t<Weight<Real>> weight, int64_t rows,
                    int64_t in, int64_t out) {
  gemm(false, true, rows, out, in, Real(1), x, in, weight, in, Real(0), y, out);
}

// The backward comes in two parts that need different inputs, so a pipeline
// can run the weight part later (zero-bubble schedules' I and W):
//   input:  dx[N, in] = dy[N, out] W[out, in]
//   weight: dW[out, in] += dy^T x
template <typename Real>
void linear_backward_input(Real* dx, const Real* dy, std::type_identity_t<Weight<Real>> weight,
                           int64_t rows, int64_t in, int64_t out) {
  gemm(false, false, rows, in, out, Real(1), dy, out, weight, in, Real(0), dx, in);
}

template <typename Real>
void linear_backward_weight(Real* d_weight, const Real* dy, const Real* x, int64_t rows, int64_t in,
                            int64_t out) {
  gemm(true, false, out, in, rows, Real(1), dy, out, x, in, Real(1), d_weight, in);
}

// ---------------------------------------------------------------------------
// Conv1D, GPT-2's linear, without bias: y[N, out] = x[N, in] W[in, out]

template <typename Real>
void conv1d_forward(Real* y, const Real* x, std::type_identity_t<Weight<Real>> weight, int64_t rows,
                    int64_t in, int64_t out) {
  gemm(false, false, rows, out, in, Real(1), x, in, weight, out, Real(0), y, out);
}

// In two parts, as the linear's:
//   input:  dx[N, in] = dy[N, out] W[in, out]^T
//   weight: dW[in, out] += x^T dy
template <typename Real>
void conv1d_backward_input(Real* dx, const Real* dy, std::type_identity_t<Weight<Real>> weight,
                           int64_t rows, int64_t in, int64_t out) {
  gemm(false, true, rows, in, out, Real(1), dy, out, weight, out, Real(0), dx, in);
}

template <typename Real>
void conv1d_backward_weight(Real* d_weight, const Real* dy, const Real* x, int64_t rows, int64_t in,
                            int64_t out) {
  gemm(true, false, in, out, rows, Real(1), x, in, dy, out, Real(1), d_weight, out);
}

// ---------------------------------------------------------------------------
// Bias: y[r, :] += b, in place on a linear's output.

template <typename Real>
void bias_forward(Real* y, const Real* bias, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < dim; ++i) y[r * dim + i] += bias[i];
  }
}

// db += sum over rows of dy[r, :]
template <typename Real>
void bias_backward(Real* d_bias, const Real* dy, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < dim; ++i) d_bias[i] += dy[r * dim + i];
  }
}

// ---------------------------------------------------------------------------
// Residual connection: out = x + delta. Its backward hands dL/dout to both
// inputs unchanged, which the model does by keeping one gradient buffer for
// the residual stream that the branches accumulate into.

template <typename Real>
void residual_forward(Real* out, const Real* x, const Real* delta, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = x[i] + delta[i];
}

// ---------------------------------------------------------------------------
// RMSNorm per row: y_i = x_i * r * w_i, r = (mean_j x_j^2 + eps)^(-1/2).
// r is kept per row for the backward.

template <typename Real>
void rmsnorm_forward(Real* y, Real* rstd, const Real* x, const Real* weight, int64_t rows,
                     int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const Real* x_row = x + r * dim;
    Real sum_squares = 0;
    for (int64_t i = 0; i < dim; ++i) sum_squares += x_row[i] * x_row[i];
    const Real s = Real(1) / std::sqrt(sum_squares / Real(dim) + Real(eps));
    for (int64_t i = 0; i < dim; ++i) y[r * dim + i] = x_row[i] * s * weight[i];
    rstd[r] = s;
  }
}

// dr/dx_j = -r^3 x_j / dim, so
//   dx_j += r * (dy_j w_j - x_j r^2 / dim * sum_i dy_i w_i x_i)
//   dw_i += sum over rows of dy_i x_i r
// dx accumulates: it is the residual stream's gradient, which also flows past
// the norm unchanged.
template <typename Real>
void rmsnorm_backward(Real* dx, Real* d_weight, const Real* dy, const Real* x, const Real* weight,
                      const Real* rstd, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    const Real* x_row = x + r * dim;
    const Real* dy_row = dy + r * dim;
    const Real s = rstd[r];
    Real dot = 0;
    for (int64_t i = 0; i < dim; ++i) dot += dy_row[i] * weight[i] * x_row[i];
    const Real coefficient = s * s * dot / Real(dim);
    for (int64_t i = 0; i < dim; ++i) {
      dx[r * dim + i] += s * (dy_row[i] * weight[i] - x_row[i] * coefficient);
      d_weight[i] += dy_row[i] * x_row[i] * s;
    }
  }
}

// ---------------------------------------------------------------------------
// LayerNorm per row: y_i = (x_i - m) r w_i + b_i, m = mean_j x_j,
// r = (mean_j (x_j - m)^2 + eps)^(-1/2). m and r are kept per row.

template <typename Real>
void layernorm_forward(Real* y, Real* mean, Real* rstd, const Real* x, const Real* weight,
                       const Real* bias, int64_t rows, int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const Real* x_row = x + r * dim;
    Real sum = 0;
    for (int64_t i = 0; i < dim; ++i) sum += x_row[i];
    const Real m = sum / Real(dim);
    Real sum_squares = 0;
    for (int64_t i = 0; i < dim; ++i) sum_squares += (x_row[i] - m) * (x_row[i] - m);
    const Real s = Real(1) / std::sqrt(sum_squares / Real(dim) + Real(eps));
    for (int64_t i = 0; i < dim; ++i) y[r * dim + i] = (x_row[i] - m) * s * weight[i] + bias[i];
    mean[r] = m;
    rstd[r] = s;
  }
}

// With n_i = (x_i - m) r the normalized input and g_i = dy_i w_i:
//   dx_i += r (g_i - mean_j g_j - n_i mean_j g_j n_j)
//   dw_i += sum over rows of dy_i n_i,  db_i += sum over rows of dy_i
// dx accumulates, as rmsnorm_backward's.
template <typename Real>
void layernorm_backward(Real* dx, Real* d_weight, Real* d_bias, const Real* dy, const Real* x,
                        const Real* weight, const Real* mean, const Real* rstd, int64_t rows,
                        int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    const Real* x_row = x + r * dim;
    const Real* dy_row = dy + r * dim;
    const Real m = mean[r], s = rstd[r];
    Real g_sum = 0, gn_sum = 0;
    for (int64_t i = 0; i < dim; ++i) {
      const Real g = dy_row[i] * weight[i];
      g_sum += g;
      gn_sum += g * (x_row[i] - m) * s;
    }
    const Real g_mean = g_sum / Real(dim), gn_mean = gn_sum / Real(dim);
    for (int64_t i = 0; i < dim; ++i) {
      const Real n = (x_row[i] - m) * s;
      dx[r * dim + i] += s * (dy_row[i] * weight[i] - g_mean - n * gn_mean);
      d_weight[i] += dy_row[i] * n;
      d_bias[i] += dy_row[i];
    }
  }
}

// ---------------------------------------------------------------------------
// Rotary position embedding, Hugging Face convention. For head_dim d and
// i < d/2: inv_freq_i = theta^(-2i/d), angle = pos * inv_freq_i, and with
// emb = concat(angles, angles): x' = x cos(emb) + rotate_half(x) sin(emb),
// rotate_half(x) = concat(-x[d/2:], x[:d/2]). So each pair (x_i, x_{i+d/2})
// turns by its angle:
//   x'_i       = x_i cos - x_{i+d/2} sin
//   x'_{i+d/2} = x_{i+d/2} cos + x_i sin

//
// Partial rotary embeddings (Phi's partial_rotary_factor) turn only the
// first rotary_dim channels of each head, with d = rotary_dim above.
template <typename Real>
struct RotaryTable {
  int64_t half_dim = 0;
  int64_t head_dim = 0;   // the distance between heads in a row
  std::vector<Real> cos;  // [seq_len, half_dim]
  std::vector<Real> sin;  // [seq_len, half_dim]

  // Row t turns by the angles of position t.
  RotaryTable(int64_t head_dim, int64_t seq_len, double theta)
      : RotaryTable(head_dim, counting(seq_len), theta) {}
  // Row t turns by the angles of positions[t] (a context-parallel rank's
  // rows are not contiguous); rotary_dim 0 turns the whole head.
  RotaryTable(int64_t head_dim, const std::vector<int64_t>& positions, double theta,
              int64_t rotary_dim = 0)
      : half_dim((rotary_dim > 0 ? rotary_dim : head_dim) / 2),
        head_dim(head_dim),
        cos(positions.size() * size_t(half_dim)),
        sin(positions.size() * size_t(half_dim)) {
    for (size_t t = 0; t < positions.size(); ++t) {
      for (int64_t i = 0; i < half_dim; ++i) {
        const double inv_freq = std::pow(theta, -2.0 * double(i) / double(2 * half_dim));
        const double angle = double(positions[t]) * inv_freq;
        cos[t * size_t(half_dim) + size_t(i)] = Real(std::cos(angle));
        sin[t * size_t(half_dim) + size_t(i)] = Real(std::sin(angle));
      }
    }
  }

 private:
  static std::vector<int64_t> counting(int64_t n) {
    std::vector<int64_t> positions(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) positions[size_t(t)] = t;
    return positions;
  }
};

// Turns the first `heads` head vectors of every row by direction * angle,
// in place. Position = t within the sequence; rows are `row_stride` apart.
template <typename Real>
void rotate_heads(Real* x, const RotaryTable<Real>& table, int64_t batch, int64_t seq_len,
                  int64_t heads, int64_t row_stride, Real direction) {
  const int64_t half = table.half_dim;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq_len; ++t) {
      const Real* cos = table.cos.data() + t * half;
      const Real* sin = table.sin.data() + t * half;
      Real* row = x + (b * seq_len + t) * row_stride;
      for (int64_t h = 0; h < heads; ++h) {
        Real* first = row + h * table.head_dim;
        Real* second = first + half;
        for (int64_t i = 0; i < half; ++i) {
          const Real x1 = first[i];
          const Real x2 = second[i];
          const Real s = direction * sin[i];
          first[i] = x1 * cos[i] - x2 * s;
          second[i] = x2 * cos[i] + x1 * s;
        }
      }
    }
  }
}

template <typename Real>
void rotary_forward(Real* x, const RotaryTable<Real>& table, int64_t batch, int64_t seq_len,
                    int64_t heads, int64_t row_stride) {
  rotate_heads(x, table, batch, seq_len, heads, row_stride, Real(1));
}

// The rotation is orthogonal, so its transpose turns back by -angle:
//   dx_i = dy_i cos + dy_{i+d/2} sin,  dx_{i+d/2} = dy_{i+d/2} cos - dy_i sin
// In place on the gradient.
template <typename Real>
void rotary_backward(Real* dx, const RotaryTable<Real>& table, int64_t batch, int64_t seq_len,
                     int64_t heads, int64_t row_stride) {
  rotate_heads(dx, table, batch, seq_len, heads, row_stride, Real(-1));
}

// ---------------------------------------------------------------------------
// Grouped-query causal attention. Each row of qkv is
// [q heads (heads * d) | k heads (kv_heads * d) | v heads (kv_heads * d)];
// query head h reads kv head h / (heads / kv_heads). Per sequence and head:
//   S = Q K^T / sqrt(d), P = softmax(S) over s <= t (causal), Y = P V
// Forward keeps only each row's log-sum-exp, L_t = log sum_{s<=t} exp(S_ts),
// [batch, heads, seq]: backward recomputes P_ts = exp(S_ts - L_t) block by
// block (as flash attention does), so no [seq, seq] matrix outlives a
// call. Queries go in blocks of query_block rows: block [t0, t1) sees keys
// [0, t1) only, so the GEMMs skip most of the masked upper triangle.

struct AttentionShape {
  int64_t batch = 0;
  int64_t seq_len = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t query_block = 64;

  int64_t q_dim() const { return heads * head_dim; }
  int64_t kv_dim() const { return kv_heads * head_dim; }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  // Column offsets of query head h's q, and of its k and v, in a qkv row.
  int64_t q_offset(int64_t h) const { return h * head_dim; }
  int64_t k_offset(int64_t h) const { return q_dim() + (h / (heads / kv_heads)) * head_dim; }
  int64_t v_offset(int64_t h) const { return k_offset(h) + kv_dim(); }
  // Elements of the log-sum-exps forward keeps.
  int64_t lse_size() const { return batch * heads * seq_len; }
  // Elements of one query block's scores: the scratch attention_forward
  // takes, and each of the two attention_backward takes.
  int64_t scores_size() const { return std::min(query_block, seq_len) * seq_len; }
};

// Row t of S becomes softmax over s <= t, max subtracted; s in (t, width)
// becomes 0, where the block's GEMMs still read it. Returns the row's
// log-sum-exp.
template <typename Real>
Real causal_softmax_row(Real* row, int64_t t, int64_t width) {
  const Real max = *std::max_element(row, row + t + 1);
  Real sum = 0;
  for (int64_t s = 0; s <= t; ++s) {
    row[s] = std::exp(row[s] - max);
    sum += row[s];
  }
  const Real inv_sum = Real(1) / sum;
  for (int64_t s = 0; s <= t; ++s) row[s] *= inv_sum;
  std::fill(row + t + 1, row + width, Real(0));
  return max + std::log(sum);
}

// Rows of one sequence's q, k, v (or dY) as attention's GEMMs read them:
// under bfloat16 matmuls (float, native) a bfloat16 copy of the whole
// sequence, made once for every head and query block, where each GEMM would
// round the same rows again (k and v once per query block and query head).
template <typename Real>
class SequenceRows {
 public:
  SequenceRows(const Real* data, int64_t rows, int64_t ld) : data_(data), ld_(ld) {
    if constexpr (std::is_same_v<Real, float>) {
      if (matmul_precision() == MatmulPrecision::bfloat16 && bfloat16_matmuls_native()) {
        copy_.resize(size_t(rows * ld));
        to_bfloat16(data, copy_.data(), rows * ld);
      }
    }
  }
  // The rows from `row` on, from column `column` on.
  GemmOperand at(int64_t row, int64_t column) const requires std::is_same_v<Real, float> {
    const int64_t offset = row * ld_ + column;
    if (copy_.empty()) return {data_ + offset, nullptr, ld_};
    return {nullptr, copy_.data() + offset, ld_};
  }
  const Real* data(int64_t row, int64_t column) const { return data_ + row * ld_ + column; }
  int64_t ld() const { return ld_; }

 private:
  const Real* data_;
  int64_t ld_;
  std::vector<uint16_t> copy_;
};

// C = alpha op(A) op(B) + beta C with A, B rows of sequences, or with A
// float32 (the scores) and B rows of a sequence.
template <typename Real>
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, Real alpha,
          const SequenceRows<Real>& a, int64_t a_row, int64_t a_column, const SequenceRows<Real>& b,
          int64_t b_row, int64_t b_column, Real beta, Real* c, int64_t ldc) {
  if constexpr (std::is_same_v<Real, float>) {
    gemm(transpose_a, transpose_b, m, n, k, alpha, a.at(a_row, a_column), b.at(b_row, b_column),
         beta, c, ldc);
  } else {
    gemm(transpose_a, transpose_b, m, n, k, alpha, a.data(a_row, a_column), a.ld(),
         b.data(b_row, b_column), b.ld(), beta, c, ldc);
  }
}
template <typename Real>
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, Real alpha,
          const Real* a, int64_t lda, const SequenceRows<Real>& b, int64_t b_row, int64_t b_column,
          Real beta, Real* c, int64_t ldc) {
  if constexpr (std::is_same_v<Real, float>) {
    gemm(transpose_a, transpose_b, m, n, k, alpha, GemmOperand{a, nullptr, lda},
         b.at(b_row, b_column), beta, c, ldc);
  } else {
    gemm(transpose_a, transpose_b, m, n, k, alpha, a, lda, b.data(b_row, b_column), b.ld(), beta, c,
         ldc);
  }
}

// out: [N, heads * d]; lse: shape.lse_size(); scores: scratch of
// shape.scores_size().
template <typename Real>
void attention_forward(Real* out, Real* lse, Real* scores, const Real* qkv,
                       const AttentionShape& shape) {
  const int64_t T = shape.seq_len, d = shape.head_dim;
  const int64_t ld_qkv = shape.qkv_dim(), ld_out = shape.q_dim();
  const Real scale = Real(1) / std::sqrt(Real(d));
  for (int64_t b = 0; b < shape.batch; ++b) {
    const SequenceRows<Real> seq(qkv + b * T * ld_qkv, T, ld_qkv);
    for (int64_t h = 0; h < shape.heads; ++h) {
      Real* row_lse = lse + (b * shape.heads + h) * T;
      Real* y = out + b * T * ld_out + h * d;
      for (int64_t t0 = 0; t0 < T; t0 += shape.query_block) {
        const int64_t t1 = std::min(T, t0 + shape.query_block), rows = t1 - t0;
        gemm(false, true, rows, t1, d, scale, seq, t0, shape.q_offset(h), seq, 0, shape.k_offset(h),
             Real(0), scores, T);
        for (int64_t t = t0; t < t1; ++t) {
          row_lse[t] = causal_softmax_row(scores + (t - t0) * T, t, t1);
        }
        gemm(false, false, rows, d, t1, Real(1), scores, T, seq, 0, shape.v_offset(h), Real(0),
             y + t0 * ld_out, ld_out);
      }
    }
  }
}

// P of query block [t0, t1) of query head h from its log-sum-exps, into
// `probs` (rows of width T): P_ts = exp(S_ts - L_t) for s <= t, 0 for s in
// (t, t1).
template <typename Real>
void recompute_probabilities(Real* probs, const SequenceRows<Real>& seq, int64_t h,
                             const Real* block_lse, int64_t t0, int64_t t1,
                             const AttentionShape& shape) {
  const int64_t T = shape.seq_len;
  const Real scale = Real(1) / std::sqrt(Real(shape.head_dim));
  gemm(false, true, t1 - t0, t1, shape.head_dim, scale, seq, t0, shape.q_offset(h), seq, 0,
       shape.k_offset(h), Real(0), probs, T);
  for (int64_t t = t0; t < t1; ++t) {
    Real* row = probs + (t - t0) * T;
    for (int64_t s = 0; s <= t; ++s) row[s] = std::exp(row[s] - block_lse[t - t0]);
    std::fill(row + t + 1, row + t1, Real(0));
  }
}

// With dY the gradient of Y, per sequence, head and query block (P
// recomputed from L):
//   dV += P^T dY;  dP = dY V^T
//   dS = P * (dP - rowsum(P * dP))          (softmax backward; 0 for s > t)
//   dQ = dS K / sqrt(d);  dK += dS^T Q / sqrt(d)
// dV and dK accumulate over the blocks and over the query heads sharing a kv
// head. d_qkv is overwritten; probs and d_scores are scratch of
// shape.scores_size() each.
template <typename Real>
void attention_backward(Real* d_qkv, Real* probs, Real* d_scores, const Real* d_out,
                        const Real* qkv, const Real* lse, const AttentionShape& shape) {
  const int64_t T = shape.seq_len, d = shape.head_dim;
  const int64_t ld_qkv = shape.qkv_dim(), ld_out = shape.q_dim();
  const Real scale = Real(1) / std::sqrt(Real(d));
  std::fill_n(d_qkv, shape.batch * T * ld_qkv, Real(0));
  for (int64_t b = 0; b < shape.batch; ++b) {
    const SequenceRows<Real> seq(qkv + b * T * ld_qkv, T, ld_qkv);
    const SequenceRows<Real> dy(d_out + b * T * ld_out, T, ld_out);
    Real* d_seq = d_qkv + b * T * ld_qkv;
    for (int64_t h = 0; h < shape.heads; ++h) {
      const Real* row_lse = lse + (b * shape.heads + h) * T;
      for (int64_t t0 = 0; t0 < T; t0 += shape.query_block) {
        const int64_t t1 = std::min(T, t0 + shape.query_block), rows = t1 - t0;
        recompute_probabilities(probs, seq, h, row_lse + t0, t0, t1, shape);
        gemm(true, false, t1, d, rows, Real(1), probs, T, dy, t0, h * d, Real(1),
             d_seq + shape.v_offset(h), ld_qkv);
        gemm(false, true, rows, t1, d, Real(1), dy, t0, h * d, seq, 0, shape.v_offset(h), Real(0),
             d_scores, T);
        for (int64_t t = t0; t < t1; ++t) {
          const Real* p_row = probs + (t - t0) * T;
          Real* ds_row = d_scores + (t - t0) * T;
          Real dot = 0;
          for (int64_t s = 0; s <= t; ++s) dot += p_row[s] * ds_row[s];
          for (int64_t s = 0; s <= t; ++s) ds_row[s] = p_row[s] * (ds_row[s] - dot);
          std::fill(ds_row + t + 1, ds_row + t1, Real(0));
        }
        gemm(false, false, rows, d, t1, scale, d_scores, T, seq, 0, shape.k_offset(h), Real(0),
             d_seq + shape.q_offset(h) + t0 * ld_qkv, ld_qkv);
        gemm(true, false, t1, d, rows, scale, d_scores, T, seq, t0, shape.q_offset(h), Real(1),
             d_seq + shape.k_offset(h), ld_qkv);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// SwiGLU: each row of gate_up is [gate (dim) | up (dim)];
//   out = silu(gate) * up,  silu(a) = a * sigmoid(a)

template <typename Real>
void swiglu_forward(Real* out, const Real* gate_up, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    const Real* gate = gate_up + r * 2 * dim;
    const Real* up = gate + dim;
    for (int64_t i = 0; i < dim; ++i) {
      const Real sigmoid = Real(1) / (Real(1) + std::exp(-gate[i]));
      out[r * dim + i] = gate[i] * sigmoid * up[i];
    }
  }
}

// silu'(a) = s (1 + a (1 - s)), s = sigmoid(a), so
//   d_gate = d_out * up * silu'(gate),  d_up = d_out * silu(gate)
template <typename Real>
void swiglu_backward(Real* d_gate_up, const Real* d_out, const Real* gate_up, int64_t rows,
                     int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    const Real* gate = gate_up + r * 2 * dim;
    const Real* up = gate + dim;
    Real* d_gate = d_gate_up + r * 2 * dim;
    Real* d_up = d_gate + dim;
    for (int64_t i = 0; i < dim; ++i) {
      const Real sigmoid = Real(1) / (Real(1) + std::exp(-gate[i]));
      const Real dy = d_out[r * dim + i];
      d_gate[i] = dy * up[i] * sigmoid * (Real(1) + gate[i] * (Real(1) - sigmoid));
      d_up[i] = dy * gate[i] * sigmoid;
    }
  }
}

// ---------------------------------------------------------------------------
// GELU, tanh approximation (Hugging Face's "gelu_new", GPT-2's):
//   y = x/2 (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)

inline constexpr double kSqrt2OverPi = 0.7978845608028654;

template <typename Real>
Real gelu_tanh_argument(Real x) {
  return Real(kSqrt2OverPi) * (x + Real(0.044715) * x * x * x);
}

template <typename Real>
void gelu_forward(Real* y, const Real* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    y[i] = Real(0.5) * x[i] * (Real(1) + std::tanh(gelu_tanh_argument(x[i])));
  }
}

// dy/dx = (1 + tanh u)/2 + x/2 (1 - tanh^2 u) du/dx,
// du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// dx may be dy: each dx_i reads only dy_i, so the backward runs in place.
template <typename Real>
void gelu_backward(Real* dx, const Real* dy, const Real* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const Real t = std::tanh(gelu_tanh_argument(x[i]));
    const Real du = Real(kSqrt2OverPi) * (Real(1) + Real(3 * 0.044715) * x[i] * x[i]);
    dx[i] = dy[i] * (Real(0.5) * (Real(1) + t) + Real(0.5) * x[i] * (Real(1) - t * t) * du);
  }
}

// ---------------------------------------------------------------------------
// Mean cross-entropy over N rows, natural log:
//   L = 1/N sum_r (log sum_v exp(z_rv) - z_r,target_r)
// The logits are replaced by their softmax probabilities, which the backward
// needs.

template <typename Real>
double cross_entropy_forward(Real* logits, const int32_t* targets, int64_t rows, int64_t vocab) {
  double total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    Real* z = logits + r * vocab;
    const Real max = *std::max_element(z, z + vocab);
    const Real target_logit = z[targets[r]];
    Real sum = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      z[v] = std::exp(z[v] - max);
      sum += z[v];
    }
    const Real inv_sum = Real(1) / sum;
    for (int64_t v = 0; v < vocab; ++v) z[v] *= inv_sum;
    total += double(std::log(sum) + max - target_logit);
  }
  return total / double(rows);
}

// Vocabulary-parallel cross-entropy (common/tensor_parallel.hpp): the local
// steps of a tp rank holding logit columns [begin, begin + size) of each
// row; the caller all-reduces over tp between them, the maxima (max), then
// the sums (sum, 2 rows floats).
//   1. row_max[r] = the maximum of the rank's logits of row r;
//   2. the logits become e^(z - row_max); sums[r] = their sum,
//      sums[rows + r] = the target's logit where the rank holds it, else 0;
//   3. the logits become probabilities (divided by the summed sums[r]);
//      returns the mean over rows of log sum + max - target logit.
template <typename Real>
void vocab_parallel_row_max(Real* row_max, const Real* logits, int64_t rows, int64_t size) {
  for (int64_t r = 0; r < rows; ++r) {
    const Real* z = logits + r * size;
    row_max[r] = *std::max_element(z, z + size);
  }
}

template <typename Real>
void vocab_parallel_exponentials(Real* logits, Real* sums, const Real* row_max,
                                 const int32_t* targets, int64_t rows, int64_t begin,
                                 int64_t size) {
  for (int64_t r = 0; r < rows; ++r) {
    Real* z = logits + r * size;
    const bool holds = targets[r] >= begin && targets[r] < begin + size;
    sums[rows + r] = holds ? z[targets[r] - begin] : Real(0);
    Real sum = 0;
    for (int64_t v = 0; v < size; ++v) {
      z[v] = std::exp(z[v] - row_max[r]);
      sum += z[v];
    }
    sums[r] = sum;
  }
}

template <typename Real>
double vocab_parallel_probabilities(Real* logits, const Real* sums, const Real* row_max,
                                    int64_t rows, int64_t size) {
  double total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    Real* z = logits + r * size;
    const Real inv_sum = Real(1) / sums[r];
    for (int64_t v = 0; v < size; ++v) z[v] *= inv_sum;
    total += double(std::log(sums[r]) + row_max[r] - sums[rows + r]);
  }
  return total / double(rows);
}

// The backward on the rank's columns: probs become scale (p - onehot) / rows.
template <typename Real>
void vocab_parallel_cross_entropy_backward(Real* probs, const int32_t* targets, int64_t rows,
                                           int64_t begin, int64_t size, Real scale) {
  const Real factor = scale / Real(rows);
  for (int64_t r = 0; r < rows; ++r) {
    Real* p = probs + r * size;
    if (targets[r] >= begin && targets[r] < begin + size) p[targets[r] - begin] -= Real(1);
    for (int64_t v = 0; v < size; ++v) p[v] *= factor;
  }
}

// The gradient of scale * L: dz_rv = scale * (p_rv - [v == target_r]) / N,
// in place over the probabilities. scale is d(objective)/dL: 1 for one
// batch, 1/m for one of m microbatches whose mean losses are averaged. The
// whole vocabulary is one rank's columns.
template <typename Real>
void cross_entropy_backward(Real* probs, const int32_t* targets, int64_t rows, int64_t vocab,
                            Real scale) {
  vocab_parallel_cross_entropy_backward(probs, targets, rows, 0, vocab, scale);
}

}  // namespace meshrun::kernels
