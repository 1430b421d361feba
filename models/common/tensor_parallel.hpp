// The parallel layers any model plugin can build tensor parallelism from
// (Megatron-LM's, as AutoModel's plans place them), over the tp group the
// host hands a stage (meshrun/model.h, meshrun_model_stage_setup.tp):
//
//   column-parallel linear  y_r = x W_r^T, W_r the rank's rows of W: no
//     communication forward; the input gradient dx = sum_r dy_r W_r is a
//     partial sum, completed by reduce_partial_sums in backward
//   row-parallel linear     y = sum_r x_r W_r^T, W_r the rank's columns:
//     reduce_partial_sums completes the forward; backward needs none
//   vocabulary-parallel embedding and cross-entropy: rank r holds rows
//     [r V/tp, (r+1) V/tp) of the table and of lm_head, and the loss is
//     computed without ever gathering the full logits
//   sequence parallelism: between the blocks each rank holds only its rows
//     [r n, (r+1) n) of the residual stream (n = N / tp, the N rows of a
//     micro-batch), and the norms compute on them; a block's input is
//     gathered (gather_rows) and its row-parallel output reduce-scattered
//     (reduce_scatter_rows) instead of all-reduced
//
// A family computes its layers with local sizes (heads / tp, intermediate /
// tp, vocab / tp) and calls these at the points above; with a group of one
// rank every call is the plain single-process computation.
//
// distributed.tp_plan may replicate whole blocks instead (docs/plan.md): a
// replicated block computes with the full sizes on every rank, over
// ReplicatedOver(tp), so the same calls at the same points stay right.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/compute.hpp"
#include "common/parameters.hpp"

namespace meshrun::models {

// The ranks a stage's tensor-parallel layers span. The data of every call
// is the stage's compute's memory.
class TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup() = default;
  virtual int64_t size() const = 0;
  virtual int64_t rank() const = 0;
  // In place over the group: data[i] = sum (or max) over ranks of data[i].
  virtual void all_reduce_sum(float* data, int64_t count) = 0;
  virtual void all_reduce_max(float* data, int64_t count) = 0;
  // recv [size * count] = every rank's send [count], in rank order.
  virtual void all_gather(const float* send, float* recv, int64_t count) = 0;
  // recv [count] = this rank's count elements of the sum over ranks of
  // send [size * count].
  virtual void reduce_scatter_sum(const float* send, float* recv, int64_t count) = 0;
  // all_reduce_sum and reduce_scatter_sum, started: with asynchronous tensor
  // parallelism (distributed.enable_async_tensor_parallel) they return at
  // once and wait_started() completes them, so what runs in between
  // overlaps the communication; otherwise they complete before returning.
  virtual void start_all_reduce_sum(float* data, int64_t count) { all_reduce_sum(data, count); }
  virtual void start_reduce_scatter_sum(const float* send, float* recv, int64_t count) {
    reduce_scatter_sum(send, recv, count);
  }
  virtual void wait_started() {}
};

// The group of one rank: no tensor parallelism; its gather and
// reduce-scatter are copies on `compute` (which must outlive it).
class SingleRank : public TensorParallelGroup {
 public:
  explicit SingleRank(Compute& compute = host_compute()) : compute_(compute) {}
  int64_t size() const override { return 1; }
  int64_t rank() const override { return 0; }
  void all_reduce_sum(float* /*data*/, int64_t /*count*/) override {}
  void all_reduce_max(float* /*data*/, int64_t /*count*/) override {}
  void all_gather(const float* send, float* recv, int64_t count) override;
  void reduce_scatter_sum(const float* send, float* recv, int64_t count) override;

 private:
  Compute& compute_;
};

// The group a replicated block computes over: every rank holds the whole
// result, so a sum over ranks is complete already (no-op), a
// reduce-scatter keeps the rank's part, and a gather is tp's own. Sizes and
// ranks are tp's, so sequence-parallel rows stay split as elsewhere. Its
// copies are `compute`'s (which must outlive it).
class ReplicatedOver : public TensorParallelGroup {
 public:
  explicit ReplicatedOver(TensorParallelGroup& tp, Compute& compute = host_compute())
      : tp_(tp), compute_(compute) {}
  int64_t size() const override { return tp_.size(); }
  int64_t rank() const override { return tp_.rank(); }
  void all_reduce_sum(float* /*data*/, int64_t /*count*/) override {}
  void all_reduce_max(float* /*data*/, int64_t /*count*/) override {}
  void all_gather(const float* send, float* recv, int64_t count) override {
    tp_.all_gather(send, recv, count);
  }
  void reduce_scatter_sum(const float* send, float* recv, int64_t count) override;
  void start_all_reduce_sum(float* /*data*/, int64_t /*count*/) override {}
  void start_reduce_scatter_sum(const float* send, float* recv, int64_t count) override {
    reduce_scatter_sum(send, recv, count);
  }

 private:
  TensorParallelGroup& tp_;
  Compute& compute_;
};

// The blocks a family computes over tp or replicates as a whole
// (distributed.tp_plan): the attention of every layer, the MLP of every
// layer, the token embedding (with a tied lm_head), and the lm_head.
enum class Block { attention, mlp, embedding, head };

// A block as a description's "tp_blocks" entry names it: its modules (a
// parameter's name without the last component, '*' for a layer's index)
// and each one's torch style when the block is parallel.
struct BlockSpec {
  Block block;
  std::vector<std::pair<std::string, std::string>> modules;  // module, "colwise" | "rowwise"
};
const char* block_name(Block block);

// A module a family computes over tp: its name (for a layer's, after
// "<layer prefix><index>."), its weight's and bias's placements, its block
// and its torch style.
struct ParallelModule {
  const char* name;
  const char* weight;
  const char* bias;
  Block block;
  const char* style;
};

// A family's parallel modules: the layers' (each layer's name begins with
// layer_prefix and its index) and the root's, its embedding first and its
// lm_head, if any, last.
struct ParallelModules {
  const char* layer_prefix;
  std::vector<ParallelModule> layer, root;

  // The module of `parameter` (its name without the last component), or null
  // for one the family computes replicated only.
  const ParallelModule* find(const std::string& parameter) const;
  // The placement of `parameter`: its module's weight's or bias's, else
  // "replicate".
  std::string placement(const std::string& parameter) const;
  std::optional<Block> block(const std::string& parameter) const;
  // The blocks in model order (embedding, layers', lm_head unless tied),
  // with each module named by a pattern ('*' for the layer index).
  std::vector<BlockSpec> specs(bool tied_lm_head) const;
};

// A [model] key whose value a parallel block splits over tp ranks.
struct SplitExtent {
  const char* key;
  int64_t value;
  bool split;
};
// Throws std::invalid_argument("model.<key>: ...") for the first split
// extent tp does not divide.
void require_divisible(std::initializer_list<SplitExtent> extents, int64_t tp);

// Which blocks compute over tp; a stage's Pass sizes each block by it.
class ParallelBlocks {
 public:
  bool operator[](Block block) const { return parallel_[size_t(block)]; }
  void set(Block block, bool parallel) { parallel_[size_t(block)] = parallel; }
  // tp, or the replicated view of it, for `block`.
  TensorParallelGroup& group(Block block, TensorParallelGroup& tp,
                             ReplicatedOver& replicated) const {
    return (*this)[block] ? tp : static_cast<TensorParallelGroup&>(replicated);
  }
  // `extent` / tp for a parallel block, whole for a replicated one.
  int64_t local(Block block, int64_t extent, const TensorParallelGroup& tp) const {
    return (*this)[block] ? extent / tp.size() : extent;
  }

 private:
  std::array<bool, 4> parallel_{true, true, true, true};
};

// The sum over tp ranks of partial results: a row-parallel linear's output
// in forward, a column-parallel linear's input gradient in backward.
inline void reduce_partial_sums(TensorParallelGroup& tp, float* data, int64_t count) {
  if (tp.size() > 1) tp.all_reduce_sum(data, count);
}

// Sequence parallelism: full [rows * tp, dim] from every rank's local
// [rows, dim]; and local = this rank's rows of the sum of partial
// [rows * tp, dim] over ranks.
void gather_rows(TensorParallelGroup& tp, const float* local, float* full, int64_t rows,
                 int64_t dim);
void reduce_scatter_rows(TensorParallelGroup& tp, const float* partial, float* local, int64_t rows,
                         int64_t dim);

// The vocabulary rows [begin, begin + size) this tp rank holds.
struct VocabShard {
  int64_t begin = 0;
  int64_t size = 0;
  bool holds(int32_t token) const { return token >= begin && token < begin + size; }
};
VocabShard vocab_shard(int64_t vocab, const TensorParallelGroup& tp);
// The shard of a block: the whole vocabulary when it is replicated.
VocabShard vocab_shard(int64_t vocab, const TensorParallelGroup& tp, const ParallelBlocks& blocks,
                       Block block);

// out[r, :] = table[tokens[r], :] over the ranks: each rank looks up the
// rows of the tokens it holds, zero elsewhere (Compute::embedding_forward
// over its shard), and the sum over ranks completes them. On `compute`, as
// every function below that takes one.
void vocab_parallel_embedding_forward(float* out, const int32_t* tokens, const float* table,
                                      int64_t rows, int64_t dim, const VocabShard& shard,
                                      TensorParallelGroup& tp, Compute& compute = host_compute());
// The lookup as the residual stream holds it: every row summed over the
// ranks, or with sequence parallelism out [rows / tp, dim] = this rank's
// rows of the sum, through scratch [rows, dim].
void embedding_into_stream(float* out, float* scratch, const int32_t* tokens, const float* table,
                           int64_t rows, int64_t dim, const VocabShard& shard,
                           TensorParallelGroup& tp, bool sequence_parallel,
                           Compute& compute = host_compute());
// d_table[tokens[r] - begin, :] += d_out[r, :] for the tokens this rank holds.
void vocab_parallel_embedding_backward(float* d_table, const int32_t* tokens, const float* d_out,
                                       int64_t rows, int64_t dim, const VocabShard& shard,
                                       Compute& compute = host_compute());

// Mean cross-entropy over N rows of logits split over the vocabulary:
//   L = 1/N sum_r (M_r + log sum_v exp(z_rv - M_r) - z_r,target_r)
// with M_r = max over all ranks' logits. Each rank holds logits [N, shard]:
// one all-reduce (max) of M and one (sum) of the exp-sums and target logits
// (only the target's rank contributes it), 3N floats in all. The logits
// become the rank's softmax probabilities, which the backward needs.
double vocab_parallel_cross_entropy_forward(float* logits, const int32_t* targets, int64_t rows,
                                            const VocabShard& shard, TensorParallelGroup& tp,
                                            Compute& compute = host_compute());
// dz_rv = scale (p_rv - [v == target_r]) / N over the rank's columns, in place.
void vocab_parallel_cross_entropy_backward(float* probs, const int32_t* targets, int64_t rows,
                                           const VocabShard& shard, float scale,
                                           Compute& compute = host_compute());

// What the plan says about tensor parallelism: every parameter's placement
// ("tp" of the plan's "parameters": "replicate", "shard(0)", ...) by Hugging
// Face name, whether the stream is sequence parallel, and whether the
// collectives may overlap compute.
struct Placements {
  std::map<std::string, std::string> of;
  bool sequence_parallel = false;
  bool async = false;  // the plan's "async_tensor_parallel"
};
// Reads them from the plan JSON a stage is given; none for "{}".
Placements plan_placements(const char* plan_json);

// The blocks `placements` make parallel, where `block_of` gives the block
// of each parameter the family computes over tp (by name). Throws
// std::invalid_argument naming the parameter when the plan places one
// other than as the family computes it (`view.tp`) or "replicate", or
// replicates part of a block only.
using BlockOf = std::function<std::optional<Block>(const std::string& parameter)>;
ParallelBlocks planned_blocks(const std::vector<ParameterView>& views, const Placements& placements,
                              const BlockOf& block_of, const char* family);

}  // namespace meshrun::models
