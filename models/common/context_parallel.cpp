#include "common/context_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

#include "common/stage.hpp"

namespace meshrun::models {

using kernels::AttentionShape;
using kernels::gemm;

namespace {

constexpr int64_t kKeyValueTag = 11, kKeyValueGradientTag = 12, kAllToAllTag = 13;
// The running maximum before a row has seen any key: finite, as the model
// library is built with -ffast-math; exp(kNoMax - x) is 0 for any score.
constexpr float kNoMax = -1e30f;

// Where one query head's rows and its key/value head's rows lie: gathered
// qkv rows [T, qkv_dim] and a key/value block [T, 2 kv_dim] (k, then v).
template <class Real>
struct HeadRows {
  Real* q;
  Real* k;
  Real* v;
  int64_t ld_q, ld_kv;
};

// kv [T rows, 2 kv_dim] = the k and v columns of qkv rows [T, qkv_dim].
void pack_key_values(float* kv, const float* qkv, const AttentionShape& g) {
  const int64_t rows = g.batch * g.seq_len, kv_dim = g.kv_dim();
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(qkv + r * g.qkv_dim() + g.q_dim(), 2 * kv_dim, kv + r * 2 * kv_dim);
  }
}

template <class Real>
HeadRows<Real> head_rows(Real* qkv, Real* kv, const AttentionShape& g, int64_t b, int64_t h) {
  const int64_t T = g.seq_len, kv_head = h / (g.heads / g.kv_heads);
  Real* k = kv + b * T * 2 * g.kv_dim() + kv_head * g.head_dim;
  return {qkv + b * T * g.qkv_dim() + g.q_offset(h), k, k + g.kv_dim(), g.qkv_dim(),
          2 * g.kv_dim()};
}

// The k and v columns of qkv rows [T, qkv_dim] = kv [T, 2 kv_dim].
void unpack_key_values(float* qkv, const float* kv, const AttentionShape& g) {
  const int64_t rows = g.batch * g.seq_len, kv_width = 2 * g.kv_dim();
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(kv + r * kv_width, kv_width, qkv + r * g.qkv_dim() + g.q_dim());
  }
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

}  // namespace

void SingleContextRank::start_send(const float* /*data*/, int64_t /*count*/, int64_t /*peer*/,
                                   int64_t /*tag*/) {
  throw std::logic_error("context parallelism: a send on a group of one rank");
}

void SingleContextRank::start_recv(float* /*data*/, int64_t /*count*/, int64_t /*peer*/,
                                   int64_t /*tag*/) {
  throw std::logic_error("context parallelism: a receive on a group of one rank");
}

ContextParallel plan_context_parallel(const char* plan_json, ContextParallelGroup* group,
                                      const char* family) {
  ContextParallel cp{group, 1, 1};
  const int64_t size = cp.size();
  const auto plan = nlohmann::json::parse(plan_json != nullptr ? plan_json : "{}");
  const auto found = plan.find("context_parallel");
  if (found != plan.end() && found->is_object()) {
    cp.ring_degree = found->value("ring_degree", size);
    cp.ulysses_degree = found->value("ulysses_degree", int64_t(1));
  } else {
    cp.ring_degree = size;
  }
  require(
      cp.ring_degree >= 1 && cp.ulysses_degree >= 1 && cp.ring_degree * cp.ulysses_degree == size,
      family,
      "context parallelism: ring degree " + std::to_string(cp.ring_degree) + " x Ulysses degree " +
          std::to_string(cp.ulysses_degree) + " is not the cp group's " + std::to_string(size) +
          " ranks");
  return cp;
}

std::vector<int64_t> SequenceShard::positions() const {
  std::vector<int64_t> positions(static_cast<size_t>(local_len()));
  const int64_t c = chunk();
  for (int64_t t = 0; t < local_len(); ++t) {
    positions[size_t(t)] = ranks == 1 ? t : chunk_of(rank, t / c) * c + t % c;
  }
  return positions;
}

void SequenceShard::select(const int32_t* full, int32_t* local, int64_t batch) const {
  if (ranks == 1) {
    std::copy_n(full, batch * seq_len, local);
    return;
  }
  const int64_t c = chunk();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t half = 0; half < 2; ++half) {
      std::copy_n(full + b * seq_len + chunk_of(rank, half) * c, c,
                  local + b * local_len() + half * c);
    }
  }
}

SequenceAttention::SequenceAttention(const AttentionShape& shape, const ContextParallel& cp,
                                     const char* family, Compute& compute)
    : compute_(compute), shape_(shape), gathered_(shape), cp_(cp) {
  const int64_t size = cp.size(), u = cp.ulysses_degree;
  const int64_t rank = cp.group != nullptr ? cp.group->rank() : 0;
  sequence_ = {size, rank, shape.seq_len * size};
  positions_ = sequence_.positions();
  if (size == 1) {
    scratch_ = Buffer<float>(size_t(compute.attention_scratch(shape)), compute);
    return;
  }
  require(shape.heads % u == 0 && shape.kv_heads % u == 0, family,
          "Ulysses context parallelism splits the " + std::to_string(shape.heads) +
              " attention heads and " + std::to_string(shape.kv_heads) +
              " key/value heads of a rank over cp_ulysses_degree = " + std::to_string(u) +
              " ranks, which does not divide them");
  ring_index_ = rank / u;
  ulysses_index_ = rank % u;
  gathered_.seq_len = shape.seq_len * u;
  gathered_.heads = shape.heads / u;
  gathered_.kv_heads = shape.kv_heads / u;
  const int64_t rows = shape.batch * gathered_.seq_len;
  const int64_t block = std::min(shape.query_block, sequence_.chunk()) * sequence_.chunk();
  scores_.resize(size_t(block));
  d_scores_.resize(size_t(block));
  row_max_.resize(size_t(rows * gathered_.heads));
  row_sum_.resize(size_t(rows * gathered_.heads));
  for (auto* kv : {&kv_, &kv_next_, &d_kv_, &d_kv_in_, &d_kv_out_}) {
    kv->resize(size_t(rows * 2 * gathered_.kv_dim()));
  }
  if (u == 1) return;
  qkv_.resize(size_t(rows * gathered_.qkv_dim()));
  d_qkv_.resize(qkv_.size());
  out_.resize(size_t(rows * gathered_.q_dim()));
  d_out_.resize(out_.size());
  send_.resize(size_t(shape.batch * shape.seq_len * shape.qkv_dim()));
  recv_.resize(send_.size());
}

std::vector<int64_t> SequenceAttention::member_chunks(int64_t ring_member) const {
  std::vector<int64_t> chunks;
  for (int64_t j = 0; j < cp_.ulysses_degree; ++j) {
    for (int64_t half = 0; half < 2; ++half) {
      chunks.push_back(sequence_.chunk_of(ring_member * cp_.ulysses_degree + j, half));
    }
  }
  return chunks;
}

void SequenceAttention::all_to_all(const float* from, float* to,
                                   std::initializer_list<int64_t> widths, bool to_heads) {
  const int64_t u = cp_.ulysses_degree, rows = shape_.batch * shape_.seq_len, T = shape_.seq_len;
  int64_t width = 0;
  for (int64_t w : widths) width += w / u;
  const int64_t piece = rows * width, local_width = width * u;
  // Member j's heads in a local row: of each column group w, the columns
  // [offset + j w/u, + w/u), packed one group after another.
  const auto for_member_columns = [&](int64_t j, auto&& copy) {
    int64_t offset = 0, packed = 0;
    for (int64_t w : widths) {
      copy(offset + j * (w / u), packed, w / u);
      offset += w;
      packed += w / u;
    }
  };
  // Local row r = (b, t) is gathered row (b, j, t) of member j.
  const auto gathered_row = [&](int64_t r, int64_t j) { return ((r / T * u + j) * T + r % T); };
  for (int64_t j = 0; j < u; ++j) {
    float* packed = send_.data() + j * piece;
    for (int64_t r = 0; r < rows; ++r) {
      if (to_heads) {
        for_member_columns(j, [&](int64_t local, int64_t column, int64_t n) {
          std::copy_n(from + r * local_width + local, n, packed + r * width + column);
        });
      } else {
        std::copy_n(from + gathered_row(r, j) * width, width, packed + r * width);
      }
    }
    float* received = recv_.data() + j * piece;
    if (j == ulysses_index_) {
      std::copy_n(packed, piece, received);
      continue;
    }
    const int64_t peer = ring_index_ * u + j;
    cp_.group->start_recv(received, piece, peer, kAllToAllTag);
    cp_.group->start_send(packed, piece, peer, kAllToAllTag);
  }
  cp_.group->wait_started();
  for (int64_t j = 0; j < u; ++j) {
    const float* received = recv_.data() + j * piece;
    for (int64_t r = 0; r < rows; ++r) {
      if (to_heads) {
        std::copy_n(received + r * width, width, to + gathered_row(r, j) * width);
      } else {
        for_member_columns(j, [&](int64_t local, int64_t column, int64_t n) {
          std::copy_n(received + r * width + column, n, to + r * local_width + local);
        });
      }
    }
  }
}

void SequenceAttention::forward(float* out, float* lse, const float* qkv) {
  if (cp_.size() == 1) {
    compute_.attention_forward(shape_, out, lse, qkv, scratch_.data());
    return;
  }
  const AttentionShape& s = shape_;
  const bool ulysses = cp_.ulysses_degree > 1;
  if (ulysses) all_to_all(qkv, qkv_.data(), {s.q_dim(), s.kv_dim(), s.kv_dim()}, true);
  ring_forward(ulysses ? qkv_.data() : qkv, ulysses ? out_.data() : out, lse);
  if (ulysses) all_to_all(out_.data(), out, {s.q_dim()}, false);
}

void SequenceAttention::backward(float* d_qkv, const float* d_out, const float* qkv,
                                 const float* out, const float* lse) {
  if (cp_.size() == 1) {
    compute_.attention_backward(shape_, d_qkv, d_out, qkv, out, lse, scratch_.data());
    return;
  }
  const AttentionShape& s = shape_;
  const bool ulysses = cp_.ulysses_degree > 1;
  if (ulysses) {
    all_to_all(qkv, qkv_.data(), {s.q_dim(), s.kv_dim(), s.kv_dim()}, true);
    all_to_all(out, out_.data(), {s.q_dim()}, true);
    all_to_all(d_out, d_out_.data(), {s.q_dim()}, true);
  }
  ring_backward(ulysses ? qkv_.data() : qkv, ulysses ? out_.data() : out,
                ulysses ? d_out_.data() : d_out, ulysses ? d_qkv_.data() : d_qkv, lse);
  if (ulysses) all_to_all(d_qkv_.data(), d_qkv, {s.q_dim(), s.kv_dim(), s.kv_dim()}, false);
}

// Online softmax over the blocks, per query row t and head: with the
// running maximum m and sum l of exp(S - m), a block of scores S' gives
//   m' = max(m, max S'),  l' = l e^(m - m') + sum exp(S' - m'),
//   acc' = acc e^(m - m') + exp(S' - m') V'
// and at the end out = acc / l, L = m + log l (the log-sum-exp backward
// reads). The next block is in flight while one is computed.
void SequenceAttention::ring_forward(const float* qkv, float* out, float* lse) {
  const AttentionShape& g = gathered_;
  const int64_t r = cp_.ring_degree, T = g.seq_len, ld_out = g.q_dim();
  std::fill_n(out, g.batch * T * ld_out, 0.0f);
  std::fill(row_max_.begin(), row_max_.end(), kNoMax);
  std::fill(row_sum_.begin(), row_sum_.end(), 0.0f);
  const std::vector<int64_t> query_chunks = member_chunks(ring_index_);
  pack_key_values(kv_.data(), qkv, g);
  for (int64_t step = 0; step < r; ++step) {
    if (step + 1 < r) {
      cp_.group->start_recv(kv_next_.data(), int64_t(kv_.size()), ring_neighbour(-1), kKeyValueTag);
      cp_.group->start_send(kv_.data(), int64_t(kv_.size()), ring_neighbour(+1), kKeyValueTag);
    }
    const std::vector<int64_t> key_chunks = member_chunks((ring_index_ + r - step) % r);
    for (int64_t b = 0; b < g.batch; ++b) {
      for (int64_t h = 0; h < g.heads; ++h) {
        const HeadRows<const float> head = head_rows<const float>(qkv, kv_.data(), g, b, h);
        const int64_t stats = (b * g.heads + h) * T;
        const RunningSoftmax state{out + b * T * ld_out + h * g.head_dim, ld_out,
                                   row_max_.data() + stats, row_sum_.data() + stats};
        for_visible_blocks(query_chunks, key_chunks, sequence_.chunk(), g.query_block,
                           [&](const VisibleBlock& block) {
                             merge_block(head, state, block, g.head_dim, scores_.data());
                           });
      }
    }
    if (step + 1 < r) {
      cp_.group->wait_started();
      kv_.swap(kv_next_);
    }
  }
  finish_softmax(out, lse);
}

void SequenceAttention::finish_softmax(float* out, float* lse) const {
  const AttentionShape& g = gathered_;
  const int64_t T = g.seq_len, ld_out = g.q_dim();
  for (int64_t b = 0; b < g.batch; ++b) {
    for (int64_t h = 0; h < g.heads; ++h) {
      const int64_t stats = (b * g.heads + h) * T;
      for (int64_t t = 0; t < T; ++t) {
        float* acc_row = out + (b * T + t) * ld_out + h * g.head_dim;
        const float inv = 1.0f / row_sum_[size_t(stats + t)];
        for (int64_t e = 0; e < g.head_dim; ++e) acc_row[e] *= inv;
        lse[stats + t] = row_max_[size_t(stats + t)] + std::log(row_sum_[size_t(stats + t)]);
      }
    }
  }
}

// D_t = rowsum(dO_t * O_t) per row and head, into row_sum_.
void SequenceAttention::output_dots(const float* out, const float* d_out) {
  const AttentionShape& g = gathered_;
  const int64_t T = g.seq_len, ld_out = g.q_dim();
  for (int64_t b = 0; b < g.batch; ++b) {
    for (int64_t h = 0; h < g.heads; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const float* dy = d_out + (b * T + t) * ld_out + h * g.head_dim;
        const float* y = out + (b * T + t) * ld_out + h * g.head_dim;
        float dot = 0.0f;
        for (int64_t e = 0; e < g.head_dim; ++e) dot += dy[e] * y[e];
        row_sum_[size_t((b * g.heads + h) * T + t)] = dot;
      }
    }
  }
}

// Flash attention's backward per block, with P recomputed from the final
// log-sum-exp L and D_t = rowsum(dO_t * O_t) (= rowsum(P * dP) over all
// blocks):
//   dV += P^T dO;  dS = P * (dO V^T - D);  dQ += dS K / sqrt(d);
//   dK += dS^T Q / sqrt(d)
// Each block's dK, dV travel with it around the ring, every rank adding its
// queries' part, and end at the block's owner. The next block's keys and
// values and the current block's gradient sum so far arrive meanwhile.
void SequenceAttention::ring_backward(const float* qkv, const float* out, const float* d_out,
                                      float* d_qkv, const float* lse) {
  const AttentionShape& g = gathered_;
  const int64_t r = cp_.ring_degree, count = int64_t(kv_.size());
  output_dots(out, d_out);
  std::fill_n(d_qkv, g.batch * g.seq_len * g.qkv_dim(), 0.0f);
  pack_key_values(kv_.data(), qkv, g);
  for (int64_t step = 0; step < r; ++step) {
    if (step + 1 < r) {
      cp_.group->start_recv(kv_next_.data(), count, ring_neighbour(-1), kKeyValueTag);
      cp_.group->start_send(kv_.data(), count, ring_neighbour(+1), kKeyValueTag);
    }
    if (step > 0) {
      cp_.group->start_recv(d_kv_in_.data(), count, ring_neighbour(-1), kKeyValueGradientTag);
    }
    std::fill(d_kv_.begin(), d_kv_.end(), 0.0f);
    block_gradients(qkv, d_out, d_qkv, lse, (ring_index_ + r - step) % r);
    if (r == 1) break;
    cp_.group->wait_started();
    for (size_t i = 0; i < d_kv_.size(); ++i) {
      d_kv_out_[i] = d_kv_[i] + (step > 0 ? d_kv_in_[i] : 0.0f);
    }
    cp_.group->start_send(d_kv_out_.data(), count, ring_neighbour(+1), kKeyValueGradientTag);
    kv_.swap(kv_next_);
  }
  if (r > 1) {
    cp_.group->start_recv(d_kv_in_.data(), count, ring_neighbour(-1), kKeyValueGradientTag);
    cp_.group->wait_started();
    d_kv_.swap(d_kv_in_);
  }
  unpack_key_values(d_qkv, d_kv_.data(), g);
}

// This rank's queries' part of the gradients against the block in kv_ (of
// ring member `source`): dQ into d_qkv, dK and dV into d_kv_.
void SequenceAttention::block_gradients(const float* qkv, const float* d_out, float* d_qkv,
                                        const float* lse, int64_t source) {
  const AttentionShape& g = gathered_;
  const int64_t T = g.seq_len, ld_out = g.q_dim();
  const std::vector<int64_t> query_chunks = member_chunks(ring_index_);
  const std::vector<int64_t> key_chunks = member_chunks(source);
  for (int64_t b = 0; b < g.batch; ++b) {
    for (int64_t h = 0; h < g.heads; ++h) {
      const HeadRows<const float> head = head_rows<const float>(qkv, kv_.data(), g, b, h);
      const HeadRows<float> grad = head_rows<float>(d_qkv, d_kv_.data(), g, b, h);
      const int64_t stats = (b * g.heads + h) * T;
      const HeadBackward upstream{d_out + b * T * ld_out + h * g.head_dim, ld_out, lse + stats,
                                  row_sum_.data() + stats};
      for_visible_blocks(query_chunks, key_chunks, sequence_.chunk(), g.query_block,
                         [&](const VisibleBlock& block) {
                           block_backward(head, grad, upstream, block, g.head_dim, scores_.data(),
                                          d_scores_.data());
                         });
    }
  }
}

int64_t SequenceAttention::ring_neighbour(int64_t direction) const {
  const int64_t r = cp_.ring_degree;
  return ((ring_index_ + r + direction) % r) * cp_.ulysses_degree + ulysses_index_;
}

}  // namespace meshrun::models
