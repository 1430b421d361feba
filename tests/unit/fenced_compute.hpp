// A compute (models/common/compute.hpp) whose memory the host cannot touch
// but inside the compute's own calls, as a GPU's: the CPU's stand-in for
// device memory. Its allocations are pages mapped PROT_NONE, opened for the
// length of each call and closed again, so a read or write of them from
// anywhere else faults (the test dies with SIGSEGV, as a host access to a
// GPU's memory would crash); every pointer a call gets must lie in one of
// them (or be null), so memory the model forgot to take from the compute
// fails the test by name. The kernels are the host's: results are the host
// compute's bit for bit. Its memory (FencedMemory) may be shared with the
// test, as a GPU's is with the host that made the compute
// (tests/kit/fenced_gpu_compute.cpp).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include "common/compute.hpp"

namespace fenced {

using meshrun::models::Compute;
using meshrun::models::MatmulPrecisionSource;
using meshrun::models::Rotation;
using meshrun::models::WeightLayout;
using Weight = meshrun::kernels::Weight<float>;

// Pages mapped PROT_NONE, each allocation its own: the memory of fenced
// computes, opened only for the length of their calls.
class FencedMemory {
 public:
  FencedMemory() = default;
  FencedMemory(const FencedMemory&) = delete;
  FencedMemory& operator=(const FencedMemory&) = delete;
  ~FencedMemory() {
    for (const auto& [begin, bytes] : mapped_) munmap(begin, bytes);
  }

  void* allocate(int64_t bytes) {
    if (bytes == 0) return nullptr;
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t mapped = (size_t(bytes) + page - 1) / page * page;
    void* memory = mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) throw std::bad_alloc();
    mapped_[static_cast<char*>(memory)] = mapped;
    return memory;
  }
  void release(void* memory) noexcept {
    const auto found = mapped_.find(static_cast<char*>(memory));
    if (found == mapped_.end()) return;
    munmap(found->first, found->second);
    mapped_.erase(found);
  }
  // Whether `pointer` lies in an allocation.
  bool holds(const void* pointer) const {
    auto found = mapped_.upper_bound(static_cast<char*>(const_cast<void*>(pointer)));
    if (found == mapped_.begin()) return false;
    --found;
    return static_cast<const char*>(pointer) < found->first + found->second;
  }
  // Throws std::logic_error naming the user ("compute", ...), its call
  // `name` and number and the argument, unless every pointer is null or in
  // an allocation.
  void require_held(const char* user, const char* name, int64_t call,
                    std::initializer_list<const void*> pointers) const {
    int argument = 0;
    for (const void* pointer : pointers) {
      ++argument;
      if (pointer != nullptr && !holds(pointer)) {
        throw std::logic_error("fenced " + std::string(user) + ": " + name + " (call " +
                               std::to_string(call) + ") got a pointer outside the " + user +
                               "'s memory as its pointer argument " + std::to_string(argument));
      }
    }
  }
  // Runs `call` with every allocation open.
  template <class Call>
  void opened(Call&& call) {
    protect(PROT_READ | PROT_WRITE);
    call();
    protect(PROT_NONE);
  }
  int64_t mapped_bytes() const {
    int64_t total = 0;
    for (const auto& [begin, bytes] : mapped_) total += int64_t(bytes);
    return total;
  }

 private:
  void protect(int access) {
    for (const auto& [begin, bytes] : mapped_) mprotect(begin, bytes, access);
  }

  std::map<char*, size_t> mapped_;
};

class FencedCompute : public Compute {
 public:
  // A compute of its own memory, its GEMMs in the process's matmul precision.
  FencedCompute() : owned_(std::make_unique<FencedMemory>()), memory_(*owned_) {}
  // A compute of `memory` (which must outlive it), its GEMMs in the
  // precision `precision` returns (as a GPU compute loaded at run time reads
  // its maker's).
  FencedCompute(FencedMemory& memory, MatmulPrecisionSource precision)
      : memory_(memory), precision_(precision) {}
  FencedCompute(const FencedCompute&) = delete;
  FencedCompute& operator=(const FencedCompute&) = delete;

  // Calls made so far, and the bytes mapped now.
  int64_t calls() const { return calls_; }
  int64_t mapped_bytes() const { return memory_.mapped_bytes(); }

  void* allocate(int64_t bytes) override { return memory_.allocate(bytes); }
  void release(void* memory) noexcept override { memory_.release(memory); }
  void copy_bytes(void* to, const void* from, int64_t bytes) override {
    inside(__func__, {to, from}, [&] { host().copy_bytes(to, from, bytes); });
  }
  void zero_bytes(void* memory, int64_t bytes) override {
    inside(__func__, {memory}, [&] { host().zero_bytes(memory, bytes); });
  }
  void copy_from_host(void* to, const void* from, int64_t bytes) override {
    inside(__func__, {to}, [&] { host().copy_bytes(to, from, bytes); });
  }
  void copy_to_host(void* to, const void* from, int64_t bytes) override {
    inside(__func__, {from}, [&] { host().copy_bytes(to, from, bytes); });
  }
  void to_bfloat16(uint16_t* bits, const float* values, int64_t count) override {
    inside(__func__, {bits, values}, [&] { host().to_bfloat16(bits, values, count); });
  }
  void from_bfloat16(float* values, const uint16_t* bits, int64_t count) override {
    inside(__func__, {values, bits}, [&] { host().from_bfloat16(values, bits, count); });
  }

  void linear_forward(WeightLayout layout, float* y, const float* x, const Weight& weight,
                      int64_t rows, int64_t in, int64_t out) override {
    inside(__func__, {y, x, weight.data, weight.bfloat16},
           [&] { host().linear_forward(layout, y, x, weight, rows, in, out); });
  }
  void linear_backward_input(WeightLayout layout, float* dx, const float* dy, const Weight& weight,
                             int64_t rows, int64_t in, int64_t out) override {
    inside(__func__, {dx, dy, weight.data, weight.bfloat16},
           [&] { host().linear_backward_input(layout, dx, dy, weight, rows, in, out); });
  }
  void linear_backward_weight(WeightLayout layout, float* d_weight, const float* dy, const float* x,
                              int64_t rows, int64_t in, int64_t out) override {
    inside(__func__, {d_weight, dy, x},
           [&] { host().linear_backward_weight(layout, d_weight, dy, x, rows, in, out); });
  }
  void bias_forward(float* y, const float* bias, int64_t rows, int64_t dim) override {
    inside(__func__, {y, bias}, [&] { host().bias_forward(y, bias, rows, dim); });
  }
  void bias_backward(float* d_bias, const float* dy, int64_t rows, int64_t dim) override {
    inside(__func__, {d_bias, dy}, [&] { host().bias_backward(d_bias, dy, rows, dim); });
  }
  void add(float* out, const float* x, const float* delta, int64_t count) override {
    inside(__func__, {out, x, delta}, [&] { host().add(out, x, delta, count); });
  }
  void accumulate(float* sum, const float* addend, int64_t count) override {
    inside(__func__, {sum, addend}, [&] { host().accumulate(sum, addend, count); });
  }
  void copy_rows(float* to, int64_t ld_to, const float* from, int64_t ld_from, int64_t rows,
                 int64_t width) override {
    inside(__func__, {to, from}, [&] { host().copy_rows(to, ld_to, from, ld_from, rows, width); });
  }
  void fill(float* values, int64_t count, float value) override {
    inside(__func__, {values}, [&] { host().fill(values, count, value); });
  }
  void round_to_bfloat16(float* values, int64_t count) override {
    inside(__func__, {values}, [&] { host().round_to_bfloat16(values, count); });
  }
  void rmsnorm_forward(float* y, float* rstd, const float* x, const float* weight, int64_t rows,
                       int64_t dim, double eps) override {
    inside(__func__, {y, rstd, x, weight},
           [&] { host().rmsnorm_forward(y, rstd, x, weight, rows, dim, eps); });
  }
  void rmsnorm_backward(float* dx, float* d_weight, const float* dy, const float* x,
                        const float* weight, const float* rstd, int64_t rows,
                        int64_t dim) override {
    inside(__func__, {dx, d_weight, dy, x, weight, rstd},
           [&] { host().rmsnorm_backward(dx, d_weight, dy, x, weight, rstd, rows, dim); });
  }
  void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* weight,
                         const float* bias, int64_t rows, int64_t dim, double eps) override {
    inside(__func__, {y, mean, rstd, x, weight, bias},
           [&] { host().layernorm_forward(y, mean, rstd, x, weight, bias, rows, dim, eps); });
  }
  void layernorm_backward(float* dx, float* d_weight, float* d_bias, const float* dy,
                          const float* x, const float* weight, const float* mean, const float* rstd,
                          int64_t rows, int64_t dim) override {
    inside(__func__, {dx, d_weight, d_bias, dy, x, weight, mean, rstd}, [&] {
      host().layernorm_backward(dx, d_weight, d_bias, dy, x, weight, mean, rstd, rows, dim);
    });
  }
  void swiglu_forward(float* out, const float* gate_up, int64_t rows, int64_t dim) override {
    inside(__func__, {out, gate_up}, [&] { host().swiglu_forward(out, gate_up, rows, dim); });
  }
  void swiglu_backward(float* d_gate_up, const float* d_out, const float* gate_up, int64_t rows,
                       int64_t dim) override {
    inside(__func__, {d_gate_up, d_out, gate_up},
           [&] { host().swiglu_backward(d_gate_up, d_out, gate_up, rows, dim); });
  }
  void gelu_forward(float* y, const float* x, int64_t count) override {
    inside(__func__, {y, x}, [&] { host().gelu_forward(y, x, count); });
  }
  void gelu_backward(float* dx, const float* dy, const float* x, int64_t count) override {
    inside(__func__, {dx, dy, x}, [&] { host().gelu_backward(dx, dy, x, count); });
  }
  void embedding_forward(float* out, const int32_t* indices, const float* table, int64_t rows,
                         int64_t dim, int64_t begin, int64_t size) override {
    inside(__func__, {out, indices, table},
           [&] { host().embedding_forward(out, indices, table, rows, dim, begin, size); });
  }
  void embedding_backward(float* d_table, const int32_t* indices, const float* d_out, int64_t rows,
                          int64_t dim, int64_t begin, int64_t size) override {
    inside(__func__, {d_table, indices, d_out},
           [&] { host().embedding_backward(d_table, indices, d_out, rows, dim, begin, size); });
  }
  int64_t attention_scratch(const meshrun::kernels::AttentionShape& shape) const override {
    return host().attention_scratch(shape);
  }
  void attention_forward(const meshrun::kernels::AttentionShape& shape, float* out, float* lse,
                         const float* qkv, float* scratch) override {
    inside(__func__, {out, lse, qkv, scratch},
           [&] { host().attention_forward(shape, out, lse, qkv, scratch); });
  }
  void attention_backward(const meshrun::kernels::AttentionShape& shape, float* d_qkv,
                          const float* d_out, const float* qkv, const float* out, const float* lse,
                          float* scratch) override {
    inside(__func__, {d_qkv, d_out, qkv, out, lse, scratch},
           [&] { host().attention_backward(shape, d_qkv, d_out, qkv, out, lse, scratch); });
  }
  int64_t ring_attention_scratch(const meshrun::kernels::AttentionShape& g,
                                 int64_t chunk) const override {
    return host().ring_attention_scratch(g, chunk);
  }
  void ring_attention_merge(const meshrun::kernels::AttentionShape& g,
                            const meshrun::kernels::RingBlock& block, float* acc, float* row_max,
                            float* row_sum, const float* qkv, const float* kv,
                            float* scratch) override {
    inside(__func__, {acc, row_max, row_sum, qkv, kv, scratch},
           [&] { host().ring_attention_merge(g, block, acc, row_max, row_sum, qkv, kv, scratch); });
  }
  void ring_attention_finish(const meshrun::kernels::AttentionShape& g, float* out, float* lse,
                             const float* row_max, const float* row_sum) override {
    inside(__func__, {out, lse, row_max, row_sum},
           [&] { host().ring_attention_finish(g, out, lse, row_max, row_sum); });
  }
  void ring_attention_output_dots(const meshrun::kernels::AttentionShape& g, float* dots,
                                  const float* out, const float* d_out) override {
    inside(__func__, {dots, out, d_out},
           [&] { host().ring_attention_output_dots(g, dots, out, d_out); });
  }
  void ring_attention_block_backward(const meshrun::kernels::AttentionShape& g,
                                     const meshrun::kernels::RingBlock& block, float* d_qkv,
                                     float* d_kv, const float* qkv, const float* kv,
                                     const float* d_out, const float* lse, const float* dots,
                                     float* scratch) override {
    inside(__func__, {d_qkv, d_kv, qkv, kv, d_out, lse, dots, scratch}, [&] {
      host().ring_attention_block_backward(g, block, d_qkv, d_kv, qkv, kv, d_out, lse, dots,
                                           scratch);
    });
  }
  double cross_entropy_forward(float* logits, const int32_t* targets, int64_t rows,
                               int64_t vocab) override {
    double loss = 0;
    inside(__func__, {logits, targets},
           [&] { loss = host().cross_entropy_forward(logits, targets, rows, vocab); });
    return loss;
  }
  void vocab_parallel_row_max(float* row_max, const float* logits, int64_t rows,
                              int64_t size) override {
    inside(__func__, {row_max, logits},
           [&] { host().vocab_parallel_row_max(row_max, logits, rows, size); });
  }
  void vocab_parallel_exponentials(float* logits, float* sums, const float* row_max,
                                   const int32_t* targets, int64_t rows, int64_t begin,
                                   int64_t size) override {
    inside(__func__, {logits, sums, row_max, targets}, [&] {
      host().vocab_parallel_exponentials(logits, sums, row_max, targets, rows, begin, size);
    });
  }
  double vocab_parallel_probabilities(float* logits, const float* sums, const float* row_max,
                                      int64_t rows, int64_t size) override {
    double loss = 0;
    inside(__func__, {logits, sums, row_max},
           [&] { loss = host().vocab_parallel_probabilities(logits, sums, row_max, rows, size); });
    return loss;
  }
  void vocab_parallel_cross_entropy_backward(float* probs, const int32_t* targets, int64_t rows,
                                             int64_t begin, int64_t size, float scale) override {
    inside(__func__, {probs, targets}, [&] {
      host().vocab_parallel_cross_entropy_backward(probs, targets, rows, begin, size, scale);
    });
  }
  void softmax_rows(float* values, int64_t rows, int64_t columns) override {
    inside(__func__, {values}, [&] { host().softmax_rows(values, rows, columns); });
  }
  void softmax_rows_backward(float* d_values, const float* probs, int64_t rows,
                             int64_t columns) override {
    inside(__func__, {d_values, probs},
           [&] { host().softmax_rows_backward(d_values, probs, rows, columns); });
  }
  void moe_route(int32_t* selected, float* weights, const float* probs, int64_t rows,
                 int64_t experts, int64_t top_k) override {
    inside(__func__, {selected, weights, probs},
           [&] { host().moe_route(selected, weights, probs, rows, experts, top_k); });
  }
  // tokens_per_expert is host memory (the interface's contract).
  void moe_order_slots(int64_t* tokens_per_expert, int64_t* slot_position, const int32_t* selected,
                       int64_t rows, int64_t experts, int64_t top_k) override {
    inside(__func__, {slot_position, selected}, [&] {
      host().moe_order_slots(tokens_per_expert, slot_position, selected, rows, experts, top_k);
    });
  }
  void moe_dispatch(float* slots, const float* x, const int64_t* slot_position, int64_t rows,
                    int64_t top_k, int64_t hidden) override {
    inside(__func__, {slots, x, slot_position},
           [&] { host().moe_dispatch(slots, x, slot_position, rows, top_k, hidden); });
  }
  void moe_combine(float* y, const float* expert_outputs, const float* weights,
                   const int64_t* slot_position, int64_t rows, int64_t top_k,
                   int64_t hidden) override {
    inside(__func__, {y, expert_outputs, weights, slot_position}, [&] {
      host().moe_combine(y, expert_outputs, weights, slot_position, rows, top_k, hidden);
    });
  }
  void moe_combine_backward(float* d_slots, float* d_weights, const float* dy,
                            const float* expert_outputs, const float* weights,
                            const int64_t* slot_position, int64_t rows, int64_t top_k,
                            int64_t hidden) override {
    inside(__func__, {d_slots, d_weights, dy, expert_outputs, weights, slot_position}, [&] {
      host().moe_combine_backward(d_slots, d_weights, dy, expert_outputs, weights, slot_position,
                                  rows, top_k, hidden);
    });
  }
  void moe_dispatch_backward(float* dx, const float* d_slots, const int64_t* slot_position,
                             int64_t rows, int64_t top_k, int64_t hidden) override {
    inside(__func__, {dx, d_slots, slot_position},
           [&] { host().moe_dispatch_backward(dx, d_slots, slot_position, rows, top_k, hidden); });
  }
  // sums is host memory.
  void column_sums(double* sums, const float* values, int64_t rows, int64_t columns) override {
    inside(__func__, {values}, [&] { host().column_sums(sums, values, rows, columns); });
  }
  // aux_per_token is host memory.
  void moe_router_gradient(float* d_probs, const float* aux_per_token, const float* probs,
                           const int32_t* selected, const float* weights, const float* d_weights,
                           int64_t rows, int64_t experts, int64_t top_k) override {
    inside(__func__, {d_probs, probs, selected, weights, d_weights}, [&] {
      host().moe_router_gradient(d_probs, aux_per_token, probs, selected, weights, d_weights, rows,
                                 experts, top_k);
    });
  }

  std::unique_ptr<Rotation> rotation(const meshrun::kernels::RotaryTable<float>& table) override {
    return std::make_unique<FencedRotation>(*this, host().rotation(table));
  }

 private:
  class FencedRotation : public Rotation {
   public:
    FencedRotation(FencedCompute& compute, std::unique_ptr<Rotation> host)
        : compute_(compute), host_(std::move(host)) {}
    void forward(float* x, int64_t batch, int64_t seq_len, int64_t heads,
                 int64_t row_stride) const override {
      compute_.inside("rotation", {x},
                      [&] { host_->forward(x, batch, seq_len, heads, row_stride); });
    }
    void backward(float* dx, int64_t batch, int64_t seq_len, int64_t heads,
                  int64_t row_stride) const override {
      compute_.inside("rotation", {dx},
                      [&] { host_->backward(dx, batch, seq_len, heads, row_stride); });
    }

   private:
    FencedCompute& compute_;
    std::unique_ptr<Rotation> host_;
  };

  static Compute& host() { return meshrun::models::host_compute(); }

  // Throws std::logic_error naming the call and the argument unless every
  // pointer is null or in an allocation; then runs `call` with all
  // allocations open.
  template <class Call>
  void inside(const char* name, std::initializer_list<const void*> pointers, Call&& call) {
    memory_.require_held("compute", name, calls_, pointers);
    ++calls_;
    if (precision_ == nullptr) {
      memory_.opened(call);
      return;
    }
    const meshrun::kernels::MatmulPrecisionScope precision(precision_());
    memory_.opened(call);
  }

  std::unique_ptr<FencedMemory> owned_;
  FencedMemory& memory_;
  MatmulPrecisionSource precision_ = nullptr;
  int64_t calls_ = 0;
};

}  // namespace fenced
