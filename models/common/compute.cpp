#include "common/compute.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/experts.hpp"
#include "numeric/bfloat16.hpp"

namespace meshrun::models {

namespace {

using kernels::Weight;

class HostRotation : public Rotation {
 public:
  explicit HostRotation(const kernels::RotaryTable<float>& table) : table_(table) {}
  void forward(float* x, int64_t batch, int64_t seq_len, int64_t heads,
               int64_t row_stride) const override {
    kernels::rotary_forward(x, table_, batch, seq_len, heads, row_stride);
  }
  void backward(float* dx, int64_t batch, int64_t seq_len, int64_t heads,
                int64_t row_stride) const override {
    kernels::rotary_backward(dx, table_, batch, seq_len, heads, row_stride);
  }

 private:
  const kernels::RotaryTable<float>& table_;
};

class HostCompute : public Compute {
 public:
  void* allocate(int64_t bytes) override {
    if (bytes == 0) return nullptr;
    void* memory = std::calloc(size_t(bytes), 1);
    if (memory == nullptr) {
      throw std::runtime_error("out of memory: the host's memory (cpu) cannot give the " +
                               std::to_string(bytes) + " bytes asked for");
    }
    return memory;
  }
  void release(void* memory) noexcept override { std::free(memory); }
  void copy_bytes(void* to, const void* from, int64_t bytes) override {
    if (bytes > 0) std::memmove(to, from, size_t(bytes));
  }
  void zero_bytes(void* memory, int64_t bytes) override {
    if (bytes > 0) std::memset(memory, 0, size_t(bytes));
  }
  void copy_from_host(void* to, const void* host, int64_t bytes) override {
    copy_bytes(to, host, bytes);
  }
  void copy_to_host(void* host, const void* from, int64_t bytes) override {
    copy_bytes(host, from, bytes);
  }
  void to_bfloat16(uint16_t* bits, const float* values, int64_t count) override {
    kernels::to_bfloat16(values, bits, count);
  }
  void from_bfloat16(float* values, const uint16_t* bits, int64_t count) override {
    kernels::from_bfloat16(bits, values, count);
  }

  void linear_forward(WeightLayout layout, float* y, const float* x, const Weight<float>& weight,
                      int64_t rows, int64_t in, int64_t out) override {
    if (layout == WeightLayout::out_in) {
      kernels::linear_forward(y, x, weight, rows, in, out);
    } else {
      kernels::conv1d_forward(y, x, weight, rows, in, out);
    }
  }
  void linear_backward_input(WeightLayout layout, float* dx, const float* dy,
                             const Weight<float>& weight, int64_t rows, int64_t in,
                             int64_t out) override {
    if (layout == WeightLayout::out_in) {
      kernels::linear_backward_input(dx, dy, weight, rows, in, out);
    } else {
      kernels::conv1d_backward_input(dx, dy, weight, rows, in, out);
    }
  }
  void linear_backward_weight(WeightLayout layout, float* d_weight, const float* dy, const float* x,
                              int64_t rows, int64_t in, int64_t out) override {
    if (layout == WeightLayout::out_in) {
      kernels::linear_backward_weight(d_weight, dy, x, rows, in, out);
    } else {
      kernels::conv1d_backward_weight(d_weight, dy, x, rows, in, out);
    }
  }
  void bias_forward(float* y, const float* bias, int64_t rows, int64_t dim) override {
    kernels::bias_forward(y, bias, rows, dim);
  }
  void bias_backward(float* d_bias, const float* dy, int64_t rows, int64_t dim) override {
    kernels::bias_backward(d_bias, dy, rows, dim);
  }

  void add(float* out, const float* x, const float* delta, int64_t count) override {
    kernels::residual_forward(out, x, delta, count);
  }
  void accumulate(float* sum, const float* addend, int64_t count) override {
    kernels::residual_forward(sum, sum, addend, count);
  }
  void copy_rows(float* to, int64_t ld_to, const float* from, int64_t ld_from, int64_t rows,
                 int64_t width) override {
    for (int64_t r = 0; r < rows; ++r) std::copy_n(from + r * ld_from, width, to + r * ld_to);
  }
  void fill(float* values, int64_t count, float value) override {
    std::fill_n(values, count, value);
  }
  void round_to_bfloat16(float* values, int64_t count) override {
    kernels::round_to_bfloat16(values, values, count);
  }

  void rmsnorm_forward(float* y, float* rstd, const float* x, const float* weight, int64_t rows,
                       int64_t dim, double eps) override {
    kernels::rmsnorm_forward(y, rstd, x, weight, rows, dim, eps);
  }
  void rmsnorm_backward(float* dx, float* d_weight, const float* dy, const float* x,
                        const float* weight, const float* rstd, int64_t rows,
                        int64_t dim) override {
    kernels::rmsnorm_backward(dx, d_weight, dy, x, weight, rstd, rows, dim);
  }
  void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* weight,
                         const float* bias, int64_t rows, int64_t dim, double eps) override {
    kernels::layernorm_forward(y, mean, rstd, x, weight, bias, rows, dim, eps);
  }
  void layernorm_backward(float* dx, float* d_weight, float* d_bias, const float* dy,
                          const float* x, const float* weight, const float* mean, const float* rstd,
                          int64_t rows, int64_t dim) override {
    kernels::layernorm_backward(dx, d_weight, d_bias, dy, x, weight, mean, rstd, rows, dim);
  }

  void swiglu_forward(float* out, const float* gate_up, int64_t rows, int64_t dim) override {
    kernels::swiglu_forward(out, gate_up, rows, dim);
  }
  void swiglu_backward(float* d_gate_up, const float* d_out, const float* gate_up, int64_t rows,
                       int64_t dim) override {
    kernels::swiglu_backward(d_gate_up, d_out, gate_up, rows, dim);
  }
  void gelu_forward(float* y, const float* x, int64_t count) override {
    kernels::gelu_forward(y, x, count);
  }
  void gelu_backward(float* dx, const float* dy, const float* x, int64_t count) override {
    kernels::gelu_backward(dx, dy, x, count);
  }

  void embedding_forward(float* out, const int32_t* indices, const float* table, int64_t rows,
                         int64_t dim, int64_t begin, int64_t size) override {
    kernels::embedding_forward(out, indices, table, rows, dim, begin, size);
  }
  void embedding_backward(float* d_table, const int32_t* indices, const float* d_out, int64_t rows,
                          int64_t dim, int64_t begin, int64_t size) override {
    kernels::embedding_backward(d_table, indices, d_out, rows, dim, begin, size);
  }

  // The scores of one query block, and their gradient.
  int64_t attention_scratch(const kernels::AttentionShape& shape) const override {
    return 2 * shape.scores_size();
  }
  void attention_forward(const kernels::AttentionShape& shape, float* out, float* lse,
                         const float* qkv, float* scratch) override {
    kernels::attention_forward(out, lse, scratch, qkv, shape);
  }
  void attention_backward(const kernels::AttentionShape& shape, float* d_qkv, const float* d_out,
                          const float* qkv, const float* /*out*/, const float* lse,
                          float* scratch) override {
    kernels::attention_backward(d_qkv, scratch, scratch + shape.scores_size(), d_out, qkv, lse,
                                shape);
  }

  int64_t ring_attention_scratch(const kernels::AttentionShape& g, int64_t chunk) const override {
    return kernels::ring_scratch_size(g, chunk);
  }
  void ring_attention_merge(const kernels::AttentionShape& g, const kernels::RingBlock& block,
                            float* acc, float* row_max, float* row_sum, const float* qkv,
                            const float* kv, float* scratch) override {
    kernels::ring_merge(g, block, acc, row_max, row_sum, qkv, kv, scratch);
  }
  void ring_attention_finish(const kernels::AttentionShape& g, float* out, float* lse,
                             const float* row_max, const float* row_sum) override {
    kernels::ring_finish(g, out, lse, row_max, row_sum);
  }
  void ring_attention_output_dots(const kernels::AttentionShape& g, float* dots, const float* out,
                                  const float* d_out) override {
    kernels::ring_output_dots(g, dots, out, d_out);
  }
  void ring_attention_block_backward(const kernels::AttentionShape& g,
                                     const kernels::RingBlock& block, float* d_qkv, float* d_kv,
                                     const float* qkv, const float* kv, const float* d_out,
                                     const float* lse, const float* dots, float* scratch) override {
    kernels::ring_block_backward(g, block, d_qkv, d_kv, qkv, kv, d_out, lse, dots, scratch);
  }

  double cross_entropy_forward(float* logits, const int32_t* targets, int64_t rows,
                               int64_t vocab) override {
    return kernels::cross_entropy_forward(logits, targets, rows, vocab);
  }
  void vocab_parallel_row_max(float* row_max, const float* logits, int64_t rows,
                              int64_t size) override {
    kernels::vocab_parallel_row_max(row_max, logits, rows, size);
  }
  void vocab_parallel_exponentials(float* logits, float* sums, const float* row_max,
                                   const int32_t* targets, int64_t rows, int64_t begin,
                                   int64_t size) override {
    kernels::vocab_parallel_exponentials(logits, sums, row_max, targets, rows, begin, size);
  }
  double vocab_parallel_probabilities(float* logits, const float* sums, const float* row_max,
                                      int64_t rows, int64_t size) override {
    return kernels::vocab_parallel_probabilities(logits, sums, row_max, rows, size);
  }
  void vocab_parallel_cross_entropy_backward(float* probs, const int32_t* targets, int64_t rows,
                                             int64_t begin, int64_t size, float scale) override {
    kernels::vocab_parallel_cross_entropy_backward(probs, targets, rows, begin, size, scale);
  }

  void softmax_rows(float* values, int64_t rows, int64_t columns) override {
    kernels::softmax_rows(values, rows, columns);
  }
  void softmax_rows_backward(float* d_values, const float* probs, int64_t rows,
                             int64_t columns) override {
    kernels::softmax_rows_backward(d_values, probs, rows, columns);
  }
  void moe_route(int32_t* selected, float* weights, const float* probs, int64_t rows,
                 int64_t experts, int64_t top_k) override {
    kernels::moe_route(selected, weights, probs, rows, experts, top_k);
  }
  void moe_order_slots(int64_t* tokens_per_expert, int64_t* slot_position, const int32_t* selected,
                       int64_t rows, int64_t experts, int64_t top_k) override {
    kernels::moe_order_slots(tokens_per_expert, slot_position, selected, rows, experts, top_k);
  }
  void moe_dispatch(float* slots, const float* x, const int64_t* slot_position, int64_t rows,
                    int64_t top_k, int64_t hidden) override {
    kernels::moe_dispatch(slots, x, slot_position, rows, top_k, hidden);
  }
  void moe_combine(float* y, const float* expert_outputs, const float* weights,
                   const int64_t* slot_position, int64_t rows, int64_t top_k,
                   int64_t hidden) override {
    kernels::moe_combine(y, expert_outputs, weights, slot_position, rows, top_k, hidden);
  }
  void moe_combine_backward(float* d_slots, float* d_weights, const float* dy,
                            const float* expert_outputs, const float* weights,
                            const int64_t* slot_position, int64_t rows, int64_t top_k,
                            int64_t hidden) override {
    kernels::moe_combine_backward(d_slots, d_weights, dy, expert_outputs, weights, slot_position,
                                  rows, top_k, hidden);
  }
  void moe_dispatch_backward(float* dx, const float* d_slots, const int64_t* slot_position,
                             int64_t rows, int64_t top_k, int64_t hidden) override {
    kernels::moe_dispatch_backward(dx, d_slots, slot_position, rows, top_k, hidden);
  }
  void column_sums(double* sums, const float* values, int64_t rows, int64_t columns) override {
    kernels::column_sums(sums, values, rows, columns);
  }
  void moe_router_gradient(float* d_probs, const float* aux_per_token, const float* probs,
                           const int32_t* selected, const float* weights, const float* d_weights,
                           int64_t rows, int64_t experts, int64_t top_k) override {
    kernels::moe_router_gradient(d_probs, aux_per_token, probs, selected, weights, d_weights, rows,
                                 experts, top_k);
  }

  std::unique_ptr<Rotation> rotation(const kernels::RotaryTable<float>& table) override {
    return std::make_unique<HostRotation>(table);
  }
};

}  // namespace

Compute& host_compute() {
  static HostCompute compute;
  return compute;
}

}  // namespace meshrun::models
