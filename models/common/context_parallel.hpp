// Context parallelism: each sequence of a micro-batch split over the cp
// ranks of a stage (meshrun/model.h, meshrun_model_stage_setup.cp), so no
// rank holds the activations of a whole sequence. Everything but attention
// computes on a token alone and runs on the rank's rows unchanged;
// attention needs every earlier key, which reaches the rank two ways:
//
//   ring (cp_ring_degree r): the ranks pass their keys and values around a
//     ring, r - 1 hops; each rank merges its queries' softmax over one block
//     at a time by log-sum-exp (online softmax) while the next block is in
//     flight. Backward passes the blocks around again, with the gradients
//     of the keys and values travelling beside them back to their owner.
//   Ulysses (cp_ulysses_degree u): one all-to-all turns u ranks' rows of
//     all heads into all u ranks' rows of 1/u of the heads; attention runs
//     on those heads; another all-to-all turns the output back. Heads and
//     key/value heads must divide by u.
//
// With both degrees above 1 (cp = r * u, the hybrid) the Ulysses groups are
// u adjacent cp ranks and the ring passes their gathered blocks between the
// r groups.
//
// Load balance: the sequence is cut into 2 cp chunks of c = T / (2 cp)
// tokens and cp rank k keeps chunks k and 2 cp - 1 - k, its rows in that
// order; under the causal mask every rank then has the same work. A rank's
// rows are not contiguous, so positions (RoPE, learned position
// embeddings) come from SequenceShard::positions().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/buffer.hpp"
#include "common/compute.hpp"
#include "common/layers.hpp"

namespace meshrun::models {

// The ranks context parallelism spans, over memory of the stage's compute
// (common/compute.hpp): all-to-alls that run while the caller computes,
// and a sum.
class ContextParallelGroup {
 public:
  virtual ~ContextParallelGroup() = default;
  virtual int64_t size() const = 0;
  virtual int64_t rank() const = 0;
  // Sums `count` floats over the group, in place.
  virtual void all_reduce_sum(float* data, int64_t count) = 0;
  // Starts sending send_counts[k] floats to group rank k and receiving
  // recv_counts[k] from it (send and recv hold them in rank order, a rank's
  // own included); the buffers must stay untouched until wait_started()
  // returns, which completes every all-to-all started. Every rank starts
  // the same all-to-alls in the same order. One all-to-all, not a send and
  // a receive, so that a backend that runs its transfers on a stream in
  // order (NCCL) pairs both directions at once instead of blocking in the
  // receive.
  virtual void start_all_to_all(const float* send, const std::vector<int64_t>& send_counts,
                                float* recv, const std::vector<int64_t>& recv_counts) = 0;
  virtual void wait_started() = 0;
};

// The group of one rank: no context parallelism.
class SingleContextRank : public ContextParallelGroup {
 public:
  int64_t size() const override { return 1; }
  int64_t rank() const override { return 0; }
  void all_reduce_sum(float* /*data*/, int64_t /*count*/) override {}
  void start_all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                        const std::vector<int64_t>& recv_counts) override;
  void wait_started() override {}
};

// How the cp ranks split attention: ring_degree * ulysses_degree ranks.
struct ContextParallel {
  ContextParallelGroup* group = nullptr;  // null: one rank
  int64_t ring_degree = 1;
  int64_t ulysses_degree = 1;

  int64_t size() const { return group != nullptr ? group->size() : 1; }
};
// Reads the degrees from the plan JSON a stage is given ("context_parallel":
// {"ring_degree", "ulysses_degree"}); ring = cp when absent. Throws
// std::invalid_argument when their product is not the group's size.
ContextParallel plan_context_parallel(const char* plan_json, ContextParallelGroup* group,
                                      const char* family);

// Which rows of a sequence of seq_len tokens a cp rank holds: all of them,
// in order, on one rank.
struct SequenceShard {
  int64_t ranks = 1, rank = 0, seq_len = 0;

  int64_t chunk() const { return seq_len / (2 * ranks); }
  int64_t local_len() const { return seq_len / ranks; }
  // The chunk index of local chunk `half` (0 or 1) of cp rank `of_rank`.
  int64_t chunk_of(int64_t of_rank, int64_t half) const {
    return half == 0 ? of_rank : 2 * ranks - 1 - of_rank;
  }
  // Position in the sequence of each local row, [local_len()].
  std::vector<int64_t> positions() const;
  // local [batch, local_len] = this rank's tokens of full [batch, seq_len].
  void select(const int32_t* full, int32_t* local, int64_t batch) const;
};

// Causal grouped-query attention over a stage's rows (the AttentionShape of
// common/layers.hpp, with seq_len the rank's local_len()): the plain kernels
// on one rank, ring, Ulysses or both over cp ranks, every step a call of
// the stage's compute on its memory (the host's or a GPU's). Holds the
// scratch of one layer's call; a pass shares one over its layers.
class SequenceAttention {
 public:
  // Throws std::invalid_argument (family first) when Ulysses' degree does
  // not divide the local heads or key/value heads. `compute` (which must
  // outlive it) computes and holds its buffers; the cp group moves them.
  SequenceAttention(const kernels::AttentionShape& shape, const ContextParallel& cp,
                    const char* family, Compute& compute = host_compute());

  const kernels::AttentionShape& shape() const { return shape_; }
  // The local rows' positions in their sequence.
  const std::vector<int64_t>& positions() const { return positions_; }
  // out [N, heads * d] from qkv [N, qkv_dim]; lse (shape.lse_size()) keeps
  // what backward needs besides qkv and out.
  void forward(float* out, float* lse, const float* qkv);
  // d_qkv (overwritten) from d_out, with forward's qkv, out and lse.
  void backward(float* d_qkv, const float* d_out, const float* qkv, const float* out,
                const float* lse);

 private:
  // Over the ring, on this rank's gathered rows (its own without Ulysses).
  void ring_forward(const float* qkv, float* out, float* lse);
  void ring_backward(const float* qkv, const float* out, const float* d_out, float* d_qkv,
                     const float* lse);
  // Starts sending `send` to the next ring member and receiving the
  // previous one's into `recv`, both of the key/value blocks' size.
  void start_ring_exchange(const float* send, float* recv);
  // The cp rank of the ring member `direction` (+1 next, -1 previous) away.
  int64_t ring_neighbour(int64_t direction) const;
  // The query chunks of this rank's gathered rows, the key chunks of ring
  // member `source`'s.
  kernels::RingBlock ring_block(int64_t source) const;
  // kv = the k and v columns of gathered qkv rows; and back.
  void pack_key_values(float* kv, const float* qkv);
  void unpack_key_values(float* qkv, const float* kv);
  // Ulysses' all-to-all: local rows of all heads to gathered rows of the
  // member's heads (`to_heads`), or back; `widths` are the column groups
  // of a local row (q, k, v; or the output), each split by heads.
  void all_to_all(const float* from, float* to, std::initializer_list<int64_t> widths,
                  bool to_heads);
  std::vector<int64_t> member_chunks(int64_t ring_member) const;

  Compute& compute_;
  kernels::AttentionShape shape_;     // local rows, local heads
  kernels::AttentionShape gathered_;  // Ulysses' rows, its share of the heads
  ContextParallel cp_;
  SequenceShard sequence_;
  int64_t ring_index_ = 0, ulysses_index_ = 0;
  std::vector<int64_t> positions_;
  // The plain kernels' scratch on one rank, the ring's over several.
  Buffer<float> scratch_;
  // Gathered qkv, output (the softmax's running sum in forward), its
  // gradient and the query gradient; the row maxima and sums (the row
  // dots in backward).
  Buffer<float> qkv_, out_, d_out_, d_qkv_, row_max_, row_sum_;
  // The key/value block computed on and the next, their gradients' partial
  // sums, received and sent.
  Buffer<float> kv_, kv_next_, d_kv_, d_kv_in_, d_kv_out_;
  Buffer<float> send_, recv_;  // Ulysses' packed rows
};

}  // namespace meshrun::models
