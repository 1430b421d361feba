#include "common/context_parallel.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

#include "common/stage.hpp"

namespace meshrun::models {

using kernels::AttentionShape;

namespace {

// The running maximum before a row has seen any key: finite, as the model
// library is built with -ffast-math; exp(kNoMax - x) is 0 for any score.
constexpr float kNoMax = -1e30f;

}  // namespace

void SingleContextRank::start_all_to_all(const float* /*send*/,
                                         const std::vector<int64_t>& /*send_counts*/,
                                         float* /*recv*/,
                                         const std::vector<int64_t>& /*recv_counts*/) {
  throw std::logic_error("context parallelism: an all-to-all on a group of one rank");
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
  const auto buffer = [&compute](int64_t count) { return Buffer<float>(size_t(count), compute); };
  scratch_ = buffer(compute.ring_attention_scratch(gathered_, sequence_.chunk()));
  row_max_ = buffer(rows * gathered_.heads);
  row_sum_ = buffer(rows * gathered_.heads);
  for (auto* kv : {&kv_, &kv_next_, &d_kv_, &d_kv_in_, &d_kv_out_}) {
    *kv = buffer(rows * 2 * gathered_.kv_dim());
  }
  if (u == 1) return;
  qkv_ = buffer(rows * gathered_.qkv_dim());
  d_qkv_ = buffer(rows * gathered_.qkv_dim());
  out_ = buffer(rows * gathered_.q_dim());
  d_out_ = buffer(rows * gathered_.q_dim());
  send_ = buffer(shape.batch * shape.seq_len * shape.qkv_dim());
  recv_ = buffer(shape.batch * shape.seq_len * shape.qkv_dim());
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

kernels::RingBlock SequenceAttention::ring_block(int64_t source) const {
  return {sequence_.chunk(), member_chunks(ring_index_), member_chunks(source)};
}

void SequenceAttention::pack_key_values(float* kv, const float* qkv) {
  const AttentionShape& g = gathered_;
  compute_.copy_rows(kv, 2 * g.kv_dim(), qkv + g.q_dim(), g.qkv_dim(), g.batch * g.seq_len,
                     2 * g.kv_dim());
}

void SequenceAttention::unpack_key_values(float* qkv, const float* kv) {
  const AttentionShape& g = gathered_;
  compute_.copy_rows(qkv + g.q_dim(), g.qkv_dim(), kv, 2 * g.kv_dim(), g.batch * g.seq_len,
                     2 * g.kv_dim());
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
  // Local rows (b, t) are gathered rows (b, j, t) of member j: sequence b's
  // T rows at gathered row (b u + j) T.
  const auto gathered_rows = [&](auto* rows_of, int64_t b, int64_t j) {
    return rows_of + (b * u + j) * T * width;
  };
  std::vector<int64_t> counts(size_t(cp_.size()), 0);
  for (int64_t j = 0; j < u; ++j) {
    float* packed = send_.data() + j * piece;
    if (to_heads) {
      for_member_columns(j, [&](int64_t local, int64_t column, int64_t n) {
        compute_.copy_rows(packed + column, width, from + local, local_width, rows, n);
      });
    } else {
      for (int64_t b = 0; b < shape_.batch; ++b) {
        compute_.copy(packed + b * T * width, gathered_rows(from, b, j), T * width);
      }
    }
    counts[size_t(ring_index_ * u + j)] = piece;
  }
  cp_.group->start_all_to_all(send_.data(), counts, recv_.data(), counts);
  cp_.group->wait_started();
  for (int64_t j = 0; j < u; ++j) {
    const float* received = recv_.data() + j * piece;
    if (to_heads) {
      for (int64_t b = 0; b < shape_.batch; ++b) {
        compute_.copy(gathered_rows(to, b, j), received + b * T * width, T * width);
      }
    } else {
      for_member_columns(j, [&](int64_t local, int64_t column, int64_t n) {
        compute_.copy_rows(to + local, local_width, received + column, width, rows, n);
      });
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

void SequenceAttention::start_ring_exchange(const float* send, float* recv) {
  const auto count = int64_t(kv_.size());
  std::vector<int64_t> send_counts(size_t(cp_.size()), 0), recv_counts(send_counts);
  send_counts[size_t(ring_neighbour(+1))] = count;
  recv_counts[size_t(ring_neighbour(-1))] = count;
  cp_.group->start_all_to_all(send, send_counts, recv, recv_counts);
}

// Online softmax over the blocks (common/ring_attention.hpp), the next
// block in flight while one is merged.
void SequenceAttention::ring_forward(const float* qkv, float* out, float* lse) {
  const AttentionShape& g = gathered_;
  const int64_t r = cp_.ring_degree;
  compute_.zero(out, g.batch * g.seq_len * g.q_dim());
  compute_.fill(row_max_.data(), int64_t(row_max_.size()), kNoMax);
  compute_.zero(row_sum_.data(), int64_t(row_sum_.size()));
  pack_key_values(kv_.data(), qkv);
  for (int64_t step = 0; step < r; ++step) {
    if (step + 1 < r) start_ring_exchange(kv_.data(), kv_next_.data());
    compute_.ring_attention_merge(g, ring_block((ring_index_ + r - step) % r), out, row_max_.data(),
                                  row_sum_.data(), qkv, kv_.data(), scratch_.data());
    if (step + 1 < r) {
      cp_.group->wait_started();
      kv_.swap(kv_next_);
    }
  }
  compute_.ring_attention_finish(g, out, lse, row_max_.data(), row_sum_.data());
}

// Each block's dK, dV travel with it around the ring, every rank adding its
// queries' part, and end at the block's owner. The next block's keys and
// values and the current block's gradient sum so far arrive meanwhile.
void SequenceAttention::ring_backward(const float* qkv, const float* out, const float* d_out,
                                      float* d_qkv, const float* lse) {
  const AttentionShape& g = gathered_;
  const int64_t r = cp_.ring_degree, count = int64_t(kv_.size());
  float* dots = row_sum_.data();
  compute_.ring_attention_output_dots(g, dots, out, d_out);
  compute_.zero(d_qkv, g.batch * g.seq_len * g.qkv_dim());
  pack_key_values(kv_.data(), qkv);
  for (int64_t step = 0; step < r; ++step) {
    if (step + 1 < r) start_ring_exchange(kv_.data(), kv_next_.data());
    compute_.zero(d_kv_.data(), count);
    compute_.ring_attention_block_backward(g, ring_block((ring_index_ + r - step) % r), d_qkv,
                                           d_kv_.data(), qkv, kv_.data(), d_out, lse, dots,
                                           scratch_.data());
    if (r == 1) break;
    cp_.group->wait_started();
    if (step > 0) {
      compute_.add(d_kv_out_.data(), d_kv_.data(), d_kv_in_.data(), count);
    } else {
      compute_.copy(d_kv_out_.data(), d_kv_.data(), count);
    }
    start_ring_exchange(d_kv_out_.data(), d_kv_in_.data());
    kv_.swap(kv_next_);
  }
  if (r > 1) {
    cp_.group->wait_started();
    d_kv_.swap(d_kv_in_);
  }
  unpack_key_values(d_qkv, d_kv_.data());
}

int64_t SequenceAttention::ring_neighbour(int64_t direction) const {
  const int64_t r = cp_.ring_degree;
  return ((ring_index_ + r + direction) % r) * cp_.ulysses_degree + ulysses_index_;
}

}  // namespace meshrun::models
