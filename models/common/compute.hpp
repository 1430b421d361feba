// Where a model's layers compute: the kernels a decoder layer calls, on the
// memory of one device. The host's (host_compute(): the CPU kernels of
// common/layers.hpp) or a CUDA GPU's (common/cuda/compute.hpp: their CUDA
// twins and cuBLASLt), one interface, so that one layer code computes on
// either, and the CPU's is the GPU's oracle (tests/gpu/test_cuda_compute.cpp
// runs every call on both). Pointers are of the compute's device; a GPU's
// calls are enqueued on its stream in call order and return without
// waiting, except those that hand a value to the host (the loss, the
// tokens per expert, column sums), which wait for it. The host's calls
// throw nothing; a GPU's throw std::runtime_error naming the call and the
// CUDA or cuBLAS error (an out-of-memory naming the device and the bytes).
//
// The GEMMs follow the matmul precision of the process (numeric/gemm.hpp;
// a compute made in another library reads its maker's through a
// MatmulPrecisionSource): under bfloat16 each operand is rounded to
// bfloat16 and the products summed in float32, on either device.
//
// The kit's layer (kit/composed.cpp) calls its kernels through this, and
// so do the embedding, attention (on one cp rank and over several: ring
// and Ulysses, common/context_parallel.hpp) and the loss (plain and
// vocabulary-parallel) and a mixture of experts' steps; a stage's buffers
// are this memory (common/buffer.hpp). The GPU's compute has not run
// inside a model (docs/testing.md).
#pragma once

#include <cstdint>
#include <memory>

#include "common/layers.hpp"
#include "common/ring_attention.hpp"

namespace meshrun::models {

// How a linear's weight is stored: Hugging Face's nn.Linear [out, in]
// (y = x W^T) or GPT-2's Conv1D [in, out] (y = x W).
enum class WeightLayout { out_in, in_out };

// The rotary angles of one pass's rows (a kernels::RotaryTable), where the
// compute reads them. Made by Compute::rotation; the table must outlive it
// (the host's reads it in place, a GPU's holds a copy).
class Rotation {
 public:
  virtual ~Rotation() = default;
  // Turns the first `heads` head vectors of every row of x ([batch *
  // seq_len] rows, `row_stride` apart) by the angles of the row's position,
  // in place; the backward turns the gradient by -angle.
  virtual void forward(float* x, int64_t batch, int64_t seq_len, int64_t heads,
                       int64_t row_stride) const = 0;
  virtual void backward(float* dx, int64_t batch, int64_t seq_len, int64_t heads,
                        int64_t row_stride) const = 0;
};

// The kernels of one device. The host's is stateless (scratch is the
// caller's: attention_scratch), so it serves threads at once; a GPU's holds
// its stream, GEMM handle and small scratch, one per stage.
class Compute {
 public:
  virtual ~Compute() = default;

  // Memory of the compute's device (what common/buffer.hpp holds):
  // allocate gives `bytes` zeroed (a GPU's zeroing enqueued on its stream)
  // and throws std::runtime_error naming the device and the bytes asked
  // for (a GPU's also what is free) when it cannot; release
  // gives it back (a GPU's once the stream is done with it) and throws
  // nothing. 0 bytes gives null.
  virtual void* allocate(int64_t bytes) = 0;
  virtual void release(void* memory) noexcept = 0;
  // Copies of `bytes` and zeroing: within the compute's memory; from host memory into
  // it (the host's values read before it returns); into host memory (a
  // GPU's waits for its stream, so the values are there on return).
  virtual void copy_bytes(void* to, const void* from, int64_t bytes) = 0;
  virtual void zero_bytes(void* memory, int64_t bytes) = 0;
  virtual void copy_from_host(void* to, const void* host, int64_t bytes) = 0;
  virtual void copy_to_host(void* host, const void* from, int64_t bytes) = 0;
  // bfloat16 bits of each value (nearest even), and their widening back:
  // how kept activations are stored (common/kept_activations.hpp).
  virtual void to_bfloat16(uint16_t* bits, const float* values, int64_t count) = 0;
  virtual void from_bfloat16(float* values, const uint16_t* bits, int64_t count) = 0;

  // A linear without bias over `rows` rows, the weight as `layout` stores
  // it (its bfloat16 copy read where a bfloat16 matmul can):
  //   forward:        y [rows, out] = x [rows, in] W
  //   backward_input: dx [rows, in] = dy [rows, out] W^T   (overwritten)
  //   backward_weight: dW += dy^T x (or x^T dy, as stored)
  virtual void linear_forward(WeightLayout layout, float* y, const float* x,
                              const kernels::Weight<float>& weight, int64_t rows, int64_t in,
                              int64_t out) = 0;
  virtual void linear_backward_input(WeightLayout layout, float* dx, const float* dy,
                                     const kernels::Weight<float>& weight, int64_t rows, int64_t in,
                                     int64_t out) = 0;
  virtual void linear_backward_weight(WeightLayout layout, float* d_weight, const float* dy,
                                      const float* x, int64_t rows, int64_t in, int64_t out) = 0;
  // y[r, :] += bias; d_bias += the sum of dy's rows.
  virtual void bias_forward(float* y, const float* bias, int64_t rows, int64_t dim) = 0;
  virtual void bias_backward(float* d_bias, const float* dy, int64_t rows, int64_t dim) = 0;

  // out = x + delta (a residual connection; out may be x); sum += addend;
  // to = from; values = 0.
  virtual void add(float* out, const float* x, const float* delta, int64_t count) = 0;
  virtual void accumulate(float* sum, const float* addend, int64_t count) = 0;
  void copy(float* to, const float* from, int64_t count) {
    copy_bytes(to, from, count * int64_t(sizeof(float)));
  }
  void zero(float* values, int64_t count) { zero_bytes(values, count * int64_t(sizeof(float))); }
  // A strided copy within the compute's memory: `rows` rows of `width`
  // floats, ld_to apart in `to` and ld_from apart in `from` (not
  // overlapping); values[i] = value.
  virtual void copy_rows(float* to, int64_t ld_to, const float* from, int64_t ld_from, int64_t rows,
                         int64_t width) = 0;
  virtual void fill(float* values, int64_t count, float value) = 0;
  // Each value rounded to bfloat16 (nearest even), in place: what keeping
  // it in bfloat16 leaves (common/kept_activations.hpp).
  virtual void round_to_bfloat16(float* values, int64_t count) = 0;

  // The norms per row of `dim` (common/layers.hpp): the forward keeps 1/rms
  // (and the mean); the backward adds into dx and the weight's (and
  // bias's) gradient.
  virtual void rmsnorm_forward(float* y, float* rstd, const float* x, const float* weight,
                               int64_t rows, int64_t dim, double eps) = 0;
  virtual void rmsnorm_backward(float* dx, float* d_weight, const float* dy, const float* x,
                                const float* weight, const float* rstd, int64_t rows,
                                int64_t dim) = 0;
  virtual void layernorm_forward(float* y, float* mean, float* rstd, const float* x,
                                 const float* weight, const float* bias, int64_t rows, int64_t dim,
                                 double eps) = 0;
  virtual void layernorm_backward(float* dx, float* d_weight, float* d_bias, const float* dy,
                                  const float* x, const float* weight, const float* mean,
                                  const float* rstd, int64_t rows, int64_t dim) = 0;

  // out = silu(gate) * up over rows of [gate | up] (`dim` each); GPT-2's
  // tanh GELU; their gradients (d_gate_up, dx overwritten).
  virtual void swiglu_forward(float* out, const float* gate_up, int64_t rows, int64_t dim) = 0;
  virtual void swiglu_backward(float* d_gate_up, const float* d_out, const float* gate_up,
                               int64_t rows, int64_t dim) = 0;
  virtual void gelu_forward(float* y, const float* x, int64_t count) = 0;
  virtual void gelu_backward(float* dx, const float* dy, const float* x, int64_t count) = 0;

  // Over the table's rows [begin, begin + size) (a vocabulary-parallel
  // rank's shard; 0 and all rows for the whole table): out[r, :] =
  // table[indices[r] - begin, :], zero for an index outside; d_table[
  // indices[r] - begin, :] += d_out[r, :] for those inside, in row order
  // (indices in the compute's memory).
  virtual void embedding_forward(float* out, const int32_t* indices, const float* table,
                                 int64_t rows, int64_t dim, int64_t begin, int64_t size) = 0;
  virtual void embedding_backward(float* d_table, const int32_t* indices, const float* d_out,
                                  int64_t rows, int64_t dim, int64_t begin, int64_t size) = 0;

  // Causal grouped-query attention (common/layers.hpp's layout and
  // AttentionShape): out and the log-sum-exps lse from qkv; d_qkv
  // (overwritten) from d_out with the forward's qkv, out and lse. `scratch`
  // holds attention_scratch(shape) floats of the compute's memory.
  virtual int64_t attention_scratch(const kernels::AttentionShape& shape) const = 0;
  virtual void attention_forward(const kernels::AttentionShape& shape, float* out, float* lse,
                                 const float* qkv, float* scratch) = 0;
  virtual void attention_backward(const kernels::AttentionShape& shape, float* d_qkv,
                                  const float* d_out, const float* qkv, const float* out,
                                  const float* lse, float* scratch) = 0;

  // Ring attention's steps over cp ranks on the gathered shape g, with
  // common/ring_attention.hpp's layouts and math: a key/value block merged
  // into the running softmax (acc, row_max, row_sum); the forward's end
  // (out = acc in place, and lse); the backward's row dots; a block's part
  // of the gradients, added into d_qkv's queries and d_kv. `scratch` holds
  // ring_attention_scratch(g, block.chunk) floats of the compute's memory.
  virtual int64_t ring_attention_scratch(const kernels::AttentionShape& g, int64_t chunk) const = 0;
  virtual void ring_attention_merge(const kernels::AttentionShape& g,
                                    const kernels::RingBlock& block, float* acc, float* row_max,
                                    float* row_sum, const float* qkv, const float* kv,
                                    float* scratch) = 0;
  virtual void ring_attention_finish(const kernels::AttentionShape& g, float* out, float* lse,
                                     const float* row_max, const float* row_sum) = 0;
  virtual void ring_attention_output_dots(const kernels::AttentionShape& g, float* dots,
                                          const float* out, const float* d_out) = 0;
  virtual void ring_attention_block_backward(const kernels::AttentionShape& g,
                                             const kernels::RingBlock& block, float* d_qkv,
                                             float* d_kv, const float* qkv, const float* kv,
                                             const float* d_out, const float* lse,
                                             const float* dots, float* scratch) = 0;

  // Softmax cross-entropy over the whole vocabulary: the logits become
  // probabilities; returns the mean over rows of the natural-log loss (a
  // GPU's waits for its stream to read it). The backward: probs become
  // scale (p - onehot) / rows.
  virtual double cross_entropy_forward(float* logits, const int32_t* targets, int64_t rows,
                                       int64_t vocab) = 0;
  // Vocabulary-parallel cross-entropy's local steps on a rank's columns
  // [begin, begin + size), with the tp all-reduces between them the
  // caller's (common/layers.hpp, vocab_parallel_row_max ...): row maxima;
  // exponentials and sums [2 rows]; probabilities and the mean loss; and
  // the backward on the rank's columns (also the whole vocabulary's).
  virtual void vocab_parallel_row_max(float* row_max, const float* logits, int64_t rows,
                                      int64_t size) = 0;
  virtual void vocab_parallel_exponentials(float* logits, float* sums, const float* row_max,
                                           const int32_t* targets, int64_t rows, int64_t begin,
                                           int64_t size) = 0;
  virtual double vocab_parallel_probabilities(float* logits, const float* sums,
                                              const float* row_max, int64_t rows, int64_t size) = 0;
  virtual void vocab_parallel_cross_entropy_backward(float* probs, const int32_t* targets,
                                                     int64_t rows, int64_t begin, int64_t size,
                                                     float scale) = 0;

  // A mixture of experts' steps (common/experts.hpp, N rows of width H, E
  // experts, K = top_k): the router's softmax of each row and its backward,
  // in place; each row's top K experts and their renormalized weights; the
  // slots' dispatch order, with the tokens each expert gets written to
  // tokens_per_expert [E] in *host* memory (they size the experts' rows and
  // the all-to-alls; a GPU's waits for its stream); dispatch and combine
  // and their backwards; the router probabilities' column sums [E] in
  // double, also to host memory (the load-balancing loss); and the router
  // probabilities' gradient, aux_per_token [E] in host memory.
  virtual void softmax_rows(float* values, int64_t rows, int64_t columns) = 0;
  virtual void softmax_rows_backward(float* d_values, const float* probs, int64_t rows,
                                     int64_t columns) = 0;
  virtual void moe_route(int32_t* selected, float* weights, const float* probs, int64_t rows,
                         int64_t experts, int64_t top_k) = 0;
  virtual void moe_order_slots(int64_t* tokens_per_expert, int64_t* slot_position,
                               const int32_t* selected, int64_t rows, int64_t experts,
                               int64_t top_k) = 0;
  virtual void moe_dispatch(float* slots, const float* x, const int64_t* slot_position,
                            int64_t rows, int64_t top_k, int64_t hidden) = 0;
  virtual void moe_combine(float* y, const float* expert_outputs, const float* weights,
                           const int64_t* slot_position, int64_t rows, int64_t top_k,
                           int64_t hidden) = 0;
  virtual void moe_combine_backward(float* d_slots, float* d_weights, const float* dy,
                                    const float* expert_outputs, const float* weights,
                                    const int64_t* slot_position, int64_t rows, int64_t top_k,
                                    int64_t hidden) = 0;
  virtual void moe_dispatch_backward(float* dx, const float* d_slots, const int64_t* slot_position,
                                     int64_t rows, int64_t top_k, int64_t hidden) = 0;
  virtual void column_sums(double* sums, const float* values, int64_t rows, int64_t columns) = 0;
  virtual void moe_router_gradient(float* d_probs, const float* aux_per_token, const float* probs,
                                   const int32_t* selected, const float* weights,
                                   const float* d_weights, int64_t rows, int64_t experts,
                                   int64_t top_k) = 0;

  // `table`'s angles where this compute reads them.
  virtual std::unique_ptr<Rotation> rotation(const kernels::RotaryTable<float>& table) = 0;
};

// The host's compute: the CPU kernels, on host memory. One for the process.
Compute& host_compute();

// Where a compute reads the matmul precision its GEMMs compute in: the
// caller's numeric/gemm.hpp matmul_precision (a library that loads a
// compute at run time has its own copy of that setting).
using MatmulPrecisionSource = kernels::MatmulPrecision (*)();

}  // namespace meshrun::models
