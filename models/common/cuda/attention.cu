// common/cuda/attention.hpp's kernels. Attention: a block holds kRows warps,
// each warp one query row (forward, dQ) or one key row (dK, dV); tiles of
// kWarp rows of the other side pass through shared memory, lane j taking
// row j of the tile for its dot products, and each lane keeps kPerLane of
// its own row's output elements (i = lane + kWarp k) in registers.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/cuda/attention.hpp"

namespace meshrun::kernels::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kRows = 4;  // warps per block: rows of the block's own side
constexpr int kPerLane = int(kMaxAttentionHeadDim / kWarp);
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kBlock = 256;
constexpr int64_t kMaxBlocks = 1 << 20;

__device__ float warp_sum(float value) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(kFullMask, value, offset);
  }
  return value;
}

__device__ float warp_max(float value) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  }
  return value;
}

// Where a head's columns are, and the strides of the tensors.
struct Layout {
  int64_t seq_len, heads, kv_heads, head_dim;
  int64_t qkv_dim, q_dim, kv_dim;
  float scale;  // 1 / sqrt(head_dim)

  explicit Layout(const AttentionDims& dims)
      : seq_len(dims.seq_len),
        heads(dims.heads),
        kv_heads(dims.kv_heads),
        head_dim(dims.head_dim),
        qkv_dim((dims.heads + 2 * dims.kv_heads) * dims.head_dim),
        q_dim(dims.heads * dims.head_dim),
        kv_dim(dims.kv_heads * dims.head_dim),
        scale(1.0f / std::sqrt(float(dims.head_dim))) {}
  __device__ int64_t group() const { return heads / kv_heads; }
  __device__ int64_t q_column(int64_t h) const { return h * head_dim; }
  __device__ int64_t k_column(int64_t h) const { return q_dim + (h / group()) * head_dim; }
  __device__ int64_t v_column(int64_t h) const { return k_column(h) + kv_dim; }
  // Shared-memory row stride of a tile: one past head_dim, so that 32 lanes
  // reading column i of 32 rows hit 32 banks.
  __host__ __device__ int64_t tile_stride() const { return head_dim + 1; }
};

// Keys [0, visible) are seen by some query row of a block whose first row
// is first_row (causal: row t sees keys s <= t).
__device__ int64_t visible_keys(int64_t first_row, const Layout& layout) {
  const int64_t end = first_row + kRows;
  return end < layout.seq_len ? end : layout.seq_len;
}

// Copies rows [first, first + kWarp) (zeros past seq_len) of `source`'s
// columns [column, column + head_dim) into `tile`, with the whole block.
__device__ void load_tile(float* tile, const float* source, int64_t ld, int64_t column,
                          int64_t first, const Layout& layout) {
  for (int64_t e = threadIdx.x; e < kWarp * layout.head_dim; e += blockDim.x) {
    const int64_t j = e / layout.head_dim, i = e % layout.head_dim, row = first + j;
    tile[j * layout.tile_stride() + i] =
        row < layout.seq_len ? source[row * ld + column + i] : 0.0f;
  }
}

// Copies this warp's row `row` of `source` (columns [column, +head_dim)) to
// `own`, or nothing past seq_len.
__device__ void load_own_row(float* own, const float* source, int64_t ld, int64_t column,
                             int64_t row, const Layout& layout) {
  if (row >= layout.seq_len) return;
  for (int64_t i = threadIdx.x % kWarp; i < layout.head_dim; i += kWarp) {
    own[i] = source[row * ld + column + i];
  }
}

// sum_i a[i] b[i] over head_dim, by one lane.
__device__ float dot(const float* a, const float* b, int64_t head_dim) {
  float sum = 0;
  for (int64_t i = 0; i < head_dim; ++i) sum += a[i] * b[i];
  return sum;
}

// acc[k] += sum_j weight_j tile[j][lane + kWarp k], weight_j held by lane j.
__device__ void accumulate_rows(float (&acc)[kPerLane], float weight, const float* tile,
                                const Layout& layout) {
  const int lane = threadIdx.x % kWarp;
  for (int j = 0; j < kWarp; ++j) {
    const float weight_j = __shfl_sync(kFullMask, weight, j);
    if (weight_j == 0.0f) continue;  // the same for every lane: no divergence
    const float* row = tile + j * layout.tile_stride();
    for (int k = 0; k < kPerLane; ++k) {
      const int64_t i = lane + kWarp * k;
      if (i < layout.head_dim) acc[k] += weight_j * row[i];
    }
  }
}

// This thread's place: its lane and warp, the block's sequence and head
// (a query head, or a kv head in the key pass), and the warp's own row (a
// query row, or a key row) and whether it exists.
struct Place {
  int lane, warp;
  int64_t batch, head, first_row, row;
  bool active;
  __device__ explicit Place(const Layout& layout)
      : lane(int(threadIdx.x) % kWarp),
        warp(int(threadIdx.x) / kWarp),
        batch(blockIdx.z),
        head(blockIdx.y),
        first_row(int64_t(blockIdx.x) * kRows),
        row(first_row + warp),
        active(row < layout.seq_len) {}
};

// The block's shared memory: two tiles of kWarp rows of the other side,
// then two sets of kRows own rows (one row of each per warp).
struct Shared {
  float* tile[2];
  float* own[2];
  __device__ Shared(float* shared, const Layout& layout, const Place& place) {
    const int64_t tile_floats = kWarp * layout.tile_stride(), rows = kRows * layout.head_dim;
    tile[0] = shared;
    tile[1] = shared + tile_floats;
    own[0] = shared + 2 * tile_floats + place.warp * layout.head_dim;
    own[1] = own[0] + rows;
  }
  static size_t bytes(const AttentionDims& dims) {
    return sizeof(float) * size_t(2 * kWarp * (dims.head_dim + 1) + 2 * kRows * dims.head_dim);
  }
};

// Per query row t (online softmax over key tiles):
//   m' = max(m, max_s S_ts);  l = l e^(m - m') + sum_s e^(S_ts - m')
//   acc = acc e^(m - m') + sum_s e^(S_ts - m') V_s;  Y_t = acc / l,
//   L_t = m + log l,  S_ts = Q_t . K_s / sqrt(d) for s <= t.
__global__ void attention_forward_kernel(float* out, float* lse, const float* qkv, Layout layout) {
  extern __shared__ float shared_floats[];
  const Place place(layout);
  const Shared shared(shared_floats, layout, place);
  const int64_t d = layout.head_dim, stride = layout.tile_stride(), h = place.head, t = place.row;
  float *keys = shared.tile[0], *values = shared.tile[1], *query = shared.own[0];
  const float* seq = qkv + place.batch * layout.seq_len * layout.qkv_dim;
  load_own_row(query, seq, layout.qkv_dim, layout.q_column(h), t, layout);
  float acc[kPerLane] = {};
  float running_max = -INFINITY, running_sum = 0;
  const int64_t keys_seen = visible_keys(place.first_row, layout);
  for (int64_t s0 = 0; s0 < keys_seen; s0 += kWarp) {
    __syncthreads();  // the previous tile is used up; the query rows are in
    load_tile(keys, seq, layout.qkv_dim, layout.k_column(h), s0, layout);
    load_tile(values, seq, layout.qkv_dim, layout.v_column(h), s0, layout);
    __syncthreads();
    if (!place.active || s0 > t) continue;
    const int64_t s = s0 + place.lane;
    const float score =
        s <= t ? dot(query, keys + place.lane * stride, d) * layout.scale : -INFINITY;
    const float new_max = fmaxf(running_max, warp_max(score));
    const float p = s <= t ? expf(score - new_max) : 0.0f;
    const float correction = expf(running_max - new_max);
    running_sum = running_sum * correction + warp_sum(p);
    for (float& value : acc) value *= correction;
    accumulate_rows(acc, p, values, layout);
    running_max = new_max;
  }
  if (!place.active) return;
  float* y = out + (place.batch * layout.seq_len + t) * layout.q_dim + h * d;
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t i = place.lane + kWarp * k;
    if (i < d) y[i] = acc[k] / running_sum;
  }
  if (place.lane == 0) {
    lse[(place.batch * layout.heads + h) * layout.seq_len + t] = running_max + logf(running_sum);
  }
}

// Per query row t, with P_ts = e^(S_ts - L_t), dP_ts = dY_t . V_s and
// D_t = dY_t . Y_t (= sum_s P_ts dP_ts):
//   dS_ts = P_ts (dP_ts - D_t);  dQ_t = sum_s dS_ts K_s / sqrt(d)
// and D_t to row_dots for the key pass.
__global__ void attention_query_gradient(float* d_qkv, float* row_dots, const float* d_out,
                                         const float* out, const float* qkv, const float* lse,
                                         Layout layout) {
  extern __shared__ float shared_floats[];
  const Place place(layout);
  const Shared shared(shared_floats, layout, place);
  const int64_t d = layout.head_dim, stride = layout.tile_stride(), h = place.head, t = place.row,
                b = place.batch;
  float *keys = shared.tile[0], *values = shared.tile[1];
  float *query = shared.own[0], *dy = shared.own[1];
  const float* seq = qkv + b * layout.seq_len * layout.qkv_dim;
  const int64_t row_index = (b * layout.heads + h) * layout.seq_len + t;
  load_own_row(query, seq, layout.qkv_dim, layout.q_column(h), t, layout);
  load_own_row(dy, d_out + b * layout.seq_len * layout.q_dim, layout.q_dim, h * d, t, layout);
  float row_dot = 0, row_lse = 0;
  if (place.active) {
    const float* y = out + (b * layout.seq_len + t) * layout.q_dim + h * d;
    const float* dy_row = d_out + (b * layout.seq_len + t) * layout.q_dim + h * d;
    float partial = 0;
    for (int64_t i = place.lane; i < d; i += kWarp) partial += dy_row[i] * y[i];
    row_dot = warp_sum(partial);
    row_lse = lse[row_index];
    if (place.lane == 0) row_dots[row_index] = row_dot;
  }
  float acc[kPerLane] = {};
  const int64_t keys_seen = visible_keys(place.first_row, layout);
  for (int64_t s0 = 0; s0 < keys_seen; s0 += kWarp) {
    __syncthreads();
    load_tile(keys, seq, layout.qkv_dim, layout.k_column(h), s0, layout);
    load_tile(values, seq, layout.qkv_dim, layout.v_column(h), s0, layout);
    __syncthreads();
    if (!place.active || s0 > t) continue;
    const int64_t s = s0 + place.lane;
    float d_score = 0;
    if (s <= t) {
      const float p = expf(dot(query, keys + place.lane * stride, d) * layout.scale - row_lse);
      d_score = p * (dot(dy, values + place.lane * stride, d) - row_dot);
    }
    accumulate_rows(acc, d_score, keys, layout);
  }
  if (!place.active) return;
  float* dq = d_qkv + (b * layout.seq_len + t) * layout.qkv_dim + layout.q_column(h);
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t i = place.lane + kWarp * k;
    if (i < d) dq[i] = acc[k] * layout.scale;
  }
}

// Per key row s of kv head g, over the query heads h of its group and the
// query rows t >= s:
//   dV_s = sum P_ts dY_t;  dK_s = sum dS_ts Q_t / sqrt(d)
__global__ void attention_key_gradient(float* d_qkv, const float* row_dots, const float* d_out,
                                       const float* qkv, const float* lse, Layout layout) {
  extern __shared__ float shared_floats[];
  const Place place(layout);
  const Shared shared(shared_floats, layout, place);
  const int64_t d = layout.head_dim, stride = layout.tile_stride(), s = place.row, b = place.batch,
                group = layout.heads / layout.kv_heads;
  const int64_t first_head = place.head * group;  // of the kv head's group
  float *queries = shared.tile[0], *output_grads = shared.tile[1];
  float *key = shared.own[0], *value = shared.own[1];
  const float* seq = qkv + b * layout.seq_len * layout.qkv_dim;
  const float* dy_seq = d_out + b * layout.seq_len * layout.q_dim;
  load_own_row(key, seq, layout.qkv_dim, layout.k_column(first_head), s, layout);
  load_own_row(value, seq, layout.qkv_dim, layout.v_column(first_head), s, layout);
  float dk[kPerLane] = {}, dv[kPerLane] = {};
  for (int64_t h = first_head; h < first_head + group; ++h) {
    const float* row_lse = lse + (b * layout.heads + h) * layout.seq_len;
    const float* dots = row_dots + (b * layout.heads + h) * layout.seq_len;
    for (int64_t t0 = place.first_row / kWarp * kWarp; t0 < layout.seq_len; t0 += kWarp) {
      __syncthreads();
      load_tile(queries, seq, layout.qkv_dim, layout.q_column(h), t0, layout);
      load_tile(output_grads, dy_seq, layout.q_dim, h * d, t0, layout);
      __syncthreads();
      if (!place.active || t0 + kWarp <= s) continue;
      const int64_t t = t0 + place.lane;
      float p = 0, d_score = 0;
      if (t >= s && t < layout.seq_len) {
        p = expf(dot(queries + place.lane * stride, key, d) * layout.scale - row_lse[t]);
        d_score = p * (dot(output_grads + place.lane * stride, value, d) - dots[t]);
      }
      accumulate_rows(dv, p, output_grads, layout);
      accumulate_rows(dk, d_score, queries, layout);
    }
  }
  if (!place.active) return;
  float* row = d_qkv + (b * layout.seq_len + s) * layout.qkv_dim;
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t i = place.lane + kWarp * k;
    if (i >= d) continue;
    row[layout.k_column(first_head) + i] = dk[k] * layout.scale;
    row[layout.v_column(first_head) + i] = dv[k];
  }
}

// The ring kernels' layout: the attention's, the keys and values from a
// block [seq_len, 2 kv_dim] (k heads, then v heads), and where the rows of
// both sides lie in their sequence.
struct RingLayout : Layout {
  RingChunks chunks;
  RingLayout(const AttentionDims& dims, const RingChunks& chunks) : Layout(dims), chunks(chunks) {}
  __device__ int64_t block_ld() const { return 2 * kv_dim; }
  __device__ int64_t block_k_column(int64_t h) const { return (h / group()) * head_dim; }
  __device__ int64_t block_v_column(int64_t h) const { return block_k_column(h) + kv_dim; }
  __device__ int64_t query_position(int64_t t) const {
    return chunks.query[t / chunks.chunk] * chunks.chunk + t % chunks.chunk;
  }
  __device__ int64_t key_position(int64_t s) const {
    return chunks.key[s / chunks.chunk] * chunks.chunk + s % chunks.chunk;
  }
  // The latest query position of the kRows rows from first_row, and the
  // earliest key position of a tile of kWarp rows from first_row (each the
  // same for every thread of a block, so skipping on them keeps the
  // block's __syncthreads together).
  __device__ int64_t last_query(int64_t first_row) const {
    int64_t last = -1;
    for (int64_t t = first_row; t < first_row + kRows && t < seq_len; ++t) {
      if (query_position(t) > last) last = query_position(t);
    }
    return last;
  }
  __device__ int64_t first_key(int64_t first_row, int64_t rows) const {
    int64_t first = INT64_MAX;
    for (int64_t s = first_row; s < first_row + rows && s < seq_len; ++s) {
      if (key_position(s) < first) first = key_position(s);
    }
    return first;
  }
  __device__ int64_t last_query_of_tile(int64_t first_row) const {
    int64_t last = -1;
    for (int64_t t = first_row; t < first_row + kWarp && t < seq_len; ++t) {
      if (query_position(t) > last) last = query_position(t);
    }
    return last;
  }
};

// Streams the tiles of the key/value block that some query row of the
// thread block's rows sees through `keys` and `values`, calling f(s0), the
// tile's first row, in each warp whose row exists.
template <class F>
__device__ void for_seen_key_tiles(const RingLayout& layout, const Place& place, int64_t h,
                                   const float* block, float* keys, float* values, F&& f) {
  const int64_t last_query = layout.last_query(place.first_row);
  for (int64_t s0 = 0; s0 < layout.seq_len; s0 += kWarp) {
    if (layout.first_key(s0, kWarp) > last_query) continue;
    __syncthreads();
    load_tile(keys, block, layout.block_ld(), layout.block_k_column(h), s0, layout);
    load_tile(values, block, layout.block_ld(), layout.block_v_column(h), s0, layout);
    __syncthreads();
    if (place.active) f(s0);
  }
}

// Per query row t of head h, over the block's keys s it sees (key position
// <= query position), the online softmax step of ring_merge: the running
// maximum, sum and output read from memory and written back.
__global__ void ring_merge_kernel(float* acc, float* row_max, float* row_sum, const float* qkv,
                                  const float* kv, RingLayout layout) {
  extern __shared__ float shared_floats[];
  const Place place(layout);
  const Shared shared(shared_floats, layout, place);
  const int64_t d = layout.head_dim, stride = layout.tile_stride(), h = place.head, t = place.row,
                b = place.batch, T = layout.seq_len;
  float *keys = shared.tile[0], *values = shared.tile[1], *query = shared.own[0];
  const float* block = kv + b * T * layout.block_ld();
  load_own_row(query, qkv + b * T * layout.qkv_dim, layout.qkv_dim, layout.q_column(h), t, layout);
  const int64_t stats = (b * layout.heads + h) * T + t;
  float* acc_row = acc + (b * T + t) * layout.q_dim + h * d;
  float output[kPerLane] = {};
  float running_max = 0, running_sum = 0;
  int64_t position = -1;
  if (place.active) {
    for (int k = 0; k < kPerLane; ++k) {
      const int64_t i = place.lane + kWarp * k;
      if (i < d) output[k] = acc_row[i];
    }
    running_max = row_max[stats];
    running_sum = row_sum[stats];
    position = layout.query_position(t);
  }
  for_seen_key_tiles(layout, place, h, block, keys, values, [&](int64_t s0) {
    const int64_t s = s0 + place.lane;
    const bool seen = s < T && layout.key_position(s) <= position;
    const float score = seen ? dot(query, keys + place.lane * stride, d) * layout.scale : -INFINITY;
    const float tile_max = warp_max(score);
    if (tile_max == -INFINITY) return;  // the row sees none of the tile
    const float new_max = fmaxf(running_max, tile_max);
    const float p = seen ? expf(score - new_max) : 0.0f;
    const float correction = expf(running_max - new_max);
    running_sum = running_sum * correction + warp_sum(p);
    for (float& value : output) value *= correction;
    accumulate_rows(output, p, values, layout);
    running_max = new_max;
  });
  if (!place.active) return;
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t i = place.lane + kWarp * k;
    if (i < d) acc_row[i] = output[k];
  }
  if (place.lane == 0) {
    row_max[stats] = running_max;
    row_sum[stats] = running_sum;
  }
}

// Per row and head (index (b heads + h) seq_len + t): Y = acc / l in place
// and L = m + log l (ring_finish).
__global__ void ring_finish_kernel(float* out, float* lse, const float* row_max,
                                   const float* row_sum, Layout layout, int64_t count) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < count;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e % layout.seq_len, h = e / layout.seq_len % layout.heads,
                  b = e / (layout.seq_len * layout.heads);
    float* y = out + (b * layout.seq_len + t) * layout.q_dim + h * layout.head_dim;
    const float inverse = 1.0f / row_sum[e];
    for (int64_t i = 0; i < layout.head_dim; ++i) y[i] *= inverse;
    lse[e] = row_max[e] + logf(row_sum[e]);
  }
}

// Per row and head: D = dY . Y (ring_output_dots).
__global__ void ring_output_dots_kernel(float* dots, const float* out, const float* d_out,
                                        Layout layout, int64_t count) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < count;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e % layout.seq_len, h = e / layout.seq_len % layout.heads,
                  b = e / (layout.seq_len * layout.heads);
    const int64_t at = (b * layout.seq_len + t) * layout.q_dim + h * layout.head_dim;
    dots[e] = dot(d_out + at, out + at, layout.head_dim);
  }
}

// Per query row t of head h, over the block's keys it sees, with P_ts =
// e^(S_ts - L_t): dQ_t += sum_s P_ts (dY_t . V_s - D_t) K_s / sqrt(d).
__global__ void ring_query_gradient(float* d_qkv, const float* qkv, const float* kv,
                                    const float* d_out, const float* lse, const float* dots,
                                    RingLayout layout) {
  extern __shared__ float shared_floats[];
  const Place place(layout);
  const Shared shared(shared_floats, layout, place);
  const int64_t d = layout.head_dim, stride = layout.tile_stride(), h = place.head, t = place.row,
                b = place.batch, T = layout.seq_len;
  float *keys = shared.tile[0], *values = shared.tile[1];
  float *query = shared.own[0], *dy = shared.own[1];
  const float* block = kv + b * T * layout.block_ld();
  load_own_row(query, qkv + b * T * layout.qkv_dim, layout.qkv_dim, layout.q_column(h), t, layout);
  load_own_row(dy, d_out + b * T * layout.q_dim, layout.q_dim, h * d, t, layout);
  const int64_t stats = (b * layout.heads + h) * T + t;
  float row_lse = 0, row_dot = 0;
  int64_t position = -1;
  if (place.active) {
    row_lse = lse[stats];
    row_dot = dots[stats];
    position = layout.query_position(t);
  }
  float gradient[kPerLane] = {};
  for_seen_key_tiles(layout, place, h, block, keys, values, [&](int64_t s0) {
    const int64_t s = s0 + place.lane;
    float d_score = 0;
    if (s < T && layout.key_position(s) <= position) {
      const float p = expf(dot(query, keys + place.lane * stride, d) * layout.scale - row_lse);
      d_score = p * (dot(dy, values + place.lane * stride, d) - row_dot);
    }
    accumulate_rows(gradient, d_score, keys, layout);
  });
  if (!place.active) return;
  float* dq = d_qkv + (b * T + t) * layout.qkv_dim + layout.q_column(h);
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t i = place.lane + kWarp * k;
    if (i < d) dq[i] += gradient[k] * layout.scale;
  }
}

// Per block key row s of kv head g, over the query heads of its group and
// the query rows t that see it: dV_s += sum P_ts dY_t; dK_s += sum dS_ts
// Q_t / sqrt(d).
__global__ void ring_key_gradient(float* d_kv, const float* qkv, const float* kv,
                                  const float* d_out, const float* lse, const float* dots,
                                  RingLayout layout) {
  extern __shared__ float shared_floats[];
  const Place place(layout);
  const Shared shared(shared_floats, layout, place);
  const int64_t d = layout.head_dim, stride = layout.tile_stride(), s = place.row, b = place.batch,
                T = layout.seq_len, group = layout.heads / layout.kv_heads;
  const int64_t first_head = place.head * group;
  float *queries = shared.tile[0], *output_grads = shared.tile[1];
  float *key = shared.own[0], *value = shared.own[1];
  const float* block = kv + b * T * layout.block_ld();
  const float* seq = qkv + b * T * layout.qkv_dim;
  const float* dy_seq = d_out + b * T * layout.q_dim;
  load_own_row(key, block, layout.block_ld(), layout.block_k_column(first_head), s, layout);
  load_own_row(value, block, layout.block_ld(), layout.block_v_column(first_head), s, layout);
  const int64_t position = place.active ? layout.key_position(s) : INT64_MAX;
  const int64_t first_key = layout.first_key(place.first_row, kRows);
  float dk[kPerLane] = {}, dv[kPerLane] = {};
  for (int64_t h = first_head; h < first_head + group; ++h) {
    const float* row_lse = lse + (b * layout.heads + h) * T;
    const float* row_dots = dots + (b * layout.heads + h) * T;
    for (int64_t t0 = 0; t0 < T; t0 += kWarp) {
      if (layout.last_query_of_tile(t0) < first_key) continue;
      __syncthreads();
      load_tile(queries, seq, layout.qkv_dim, layout.q_column(h), t0, layout);
      load_tile(output_grads, dy_seq, layout.q_dim, h * d, t0, layout);
      __syncthreads();
      if (!place.active) continue;
      const int64_t t = t0 + place.lane;
      float p = 0, d_score = 0;
      if (t < T && layout.query_position(t) >= position) {
        p = expf(dot(queries + place.lane * stride, key, d) * layout.scale - row_lse[t]);
        d_score = p * (dot(output_grads + place.lane * stride, value, d) - row_dots[t]);
      }
      accumulate_rows(dv, p, output_grads, layout);
      accumulate_rows(dk, d_score, queries, layout);
    }
  }
  if (!place.active) return;
  float* row = d_kv + (b * T + s) * layout.block_ld();
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t i = place.lane + kWarp * k;
    if (i >= d) continue;
    row[layout.block_k_column(first_head) + i] += dk[k] * layout.scale;
    row[layout.block_v_column(first_head) + i] += dv[k];
  }
}

// first_i' = first_i cos - second_i sin',  second_i' = second_i cos + first_i sin',
// sin' = direction sin (the backward turns by -angle).
__global__ void rotate_kernel(float* x, const float* cos, const float* sin, int64_t rows,
                              int64_t seq_len, int64_t heads, int64_t head_dim, int64_t half,
                              int64_t row_stride, float direction) {
  const int64_t count = rows * heads * half;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < count;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e % half, h = e / half % heads, row = e / (half * heads);
    const int64_t t = row % seq_len;
    float* first = x + row * row_stride + h * head_dim;
    const float x1 = first[i], x2 = first[half + i];
    const float c = cos[t * half + i], s = direction * sin[t * half + i];
    first[i] = x1 * c - x2 * s;
    first[half + i] = x2 * c + x1 * s;
  }
}

cudaError_t rotate(float* x, const float* cos, const float* sin, int64_t batch, int64_t seq_len,
                   int64_t heads, int64_t head_dim, int64_t half_dim, int64_t row_stride,
                   float direction, cudaStream_t stream) {
  const int64_t count = batch * seq_len * heads * half_dim;
  if (count == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((count + kBlock - 1) / kBlock, kMaxBlocks);
  rotate_kernel<<<int(blocks), kBlock, 0, stream>>>(x, cos, sin, batch * seq_len, seq_len, heads,
                                                    head_dim, half_dim, row_stride, direction);
  return cudaGetLastError();
}

bool valid(const AttentionDims& dims) {
  return dims.head_dim >= 1 && dims.head_dim <= kMaxAttentionHeadDim && dims.kv_heads >= 1 &&
         dims.heads % dims.kv_heads == 0 && dims.batch >= 0 && dims.seq_len >= 0;
}

bool valid(const AttentionDims& dims, const RingChunks& chunks) {
  return valid(dims) && chunks.count >= 1 && chunks.count <= kMaxRingChunks && chunks.chunk >= 1 &&
         chunks.chunk * chunks.count == dims.seq_len;
}

int64_t row_heads(const AttentionDims& dims) { return dims.batch * dims.heads * dims.seq_len; }

int elementwise_blocks(int64_t count) {
  return int(std::min<int64_t>((count + kBlock - 1) / kBlock, kMaxBlocks));
}

dim3 grid(const AttentionDims& dims, int64_t heads) {
  return dim3(unsigned((dims.seq_len + kRows - 1) / kRows), unsigned(heads), unsigned(dims.batch));
}

}  // namespace

cudaError_t rotary_forward(float* x, const float* cos, const float* sin, int64_t batch,
                           int64_t seq_len, int64_t heads, int64_t head_dim, int64_t half_dim,
                           int64_t row_stride, cudaStream_t stream) {
  return rotate(x, cos, sin, batch, seq_len, heads, head_dim, half_dim, row_stride, 1.0f, stream);
}

cudaError_t rotary_backward(float* dx, const float* cos, const float* sin, int64_t batch,
                            int64_t seq_len, int64_t heads, int64_t head_dim, int64_t half_dim,
                            int64_t row_stride, cudaStream_t stream) {
  return rotate(dx, cos, sin, batch, seq_len, heads, head_dim, half_dim, row_stride, -1.0f, stream);
}

cudaError_t attention_forward(float* out, float* lse, const float* qkv, const AttentionDims& dims,
                              cudaStream_t stream) {
  if (!valid(dims)) return cudaErrorInvalidValue;
  if (dims.batch == 0 || dims.seq_len == 0) return cudaSuccess;
  const Layout layout(dims);
  attention_forward_kernel<<<grid(dims, dims.heads), kRows * kWarp, Shared::bytes(dims), stream>>>(
      out, lse, qkv, layout);
  return cudaGetLastError();
}

cudaError_t attention_backward(float* d_qkv, float* row_dots, const float* d_out, const float* out,
                               const float* qkv, const float* lse, const AttentionDims& dims,
                               cudaStream_t stream) {
  if (!valid(dims)) return cudaErrorInvalidValue;
  if (dims.batch == 0 || dims.seq_len == 0) return cudaSuccess;
  const Layout layout(dims);
  const size_t bytes = Shared::bytes(dims);
  attention_query_gradient<<<grid(dims, dims.heads), kRows * kWarp, bytes, stream>>>(
      d_qkv, row_dots, d_out, out, qkv, lse, layout);
  attention_key_gradient<<<grid(dims, dims.kv_heads), kRows * kWarp, bytes, stream>>>(
      d_qkv, row_dots, d_out, qkv, lse, layout);
  return cudaGetLastError();
}

cudaError_t ring_attention_merge(float* acc, float* row_max, float* row_sum, const float* qkv,
                                 const float* kv, const AttentionDims& dims,
                                 const RingChunks& chunks, cudaStream_t stream) {
  if (!valid(dims, chunks)) return cudaErrorInvalidValue;
  if (dims.batch == 0) return cudaSuccess;
  ring_merge_kernel<<<grid(dims, dims.heads), kRows * kWarp, Shared::bytes(dims), stream>>>(
      acc, row_max, row_sum, qkv, kv, RingLayout(dims, chunks));
  return cudaGetLastError();
}

cudaError_t ring_attention_finish(float* out, float* lse, const float* row_max,
                                  const float* row_sum, const AttentionDims& dims,
                                  cudaStream_t stream) {
  if (!valid(dims)) return cudaErrorInvalidValue;
  const int64_t count = row_heads(dims);
  if (count == 0) return cudaSuccess;
  ring_finish_kernel<<<elementwise_blocks(count), kBlock, 0, stream>>>(out, lse, row_max, row_sum,
                                                                       Layout(dims), count);
  return cudaGetLastError();
}

cudaError_t ring_attention_output_dots(float* dots, const float* out, const float* d_out,
                                       const AttentionDims& dims, cudaStream_t stream) {
  if (!valid(dims)) return cudaErrorInvalidValue;
  const int64_t count = row_heads(dims);
  if (count == 0) return cudaSuccess;
  ring_output_dots_kernel<<<elementwise_blocks(count), kBlock, 0, stream>>>(dots, out, d_out,
                                                                            Layout(dims), count);
  return cudaGetLastError();
}

cudaError_t ring_attention_block_backward(float* d_qkv, float* d_kv, const float* qkv,
                                          const float* kv, const float* d_out, const float* lse,
                                          const float* dots, const AttentionDims& dims,
                                          const RingChunks& chunks, cudaStream_t stream) {
  if (!valid(dims, chunks)) return cudaErrorInvalidValue;
  if (dims.batch == 0) return cudaSuccess;
  const RingLayout layout(dims, chunks);
  const size_t bytes = Shared::bytes(dims);
  ring_query_gradient<<<grid(dims, dims.heads), kRows * kWarp, bytes, stream>>>(
      d_qkv, qkv, kv, d_out, lse, dots, layout);
  ring_key_gradient<<<grid(dims, dims.kv_heads), kRows * kWarp, bytes, stream>>>(
      d_kv, qkv, kv, d_out, lse, dots, layout);
  return cudaGetLastError();
}

}  // namespace meshrun::kernels::cuda
