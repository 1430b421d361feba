#include "common/cuda/compute.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cuda/attention.hpp"
#include "common/cuda/experts.hpp"
#include "common/cuda/layers.hpp"
#include "numeric/cuda/gemm.hpp"
#include "numeric/gemm.hpp"

namespace meshrun::models {

namespace {

namespace gpu = kernels::cuda;
using kernels::Weight;

constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("cuda compute: ") + call + ": " +
                             cudaGetErrorString(status));
  }
}

void check(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("cuda compute: ") + call + ": cuBLAS status " +
                             std::to_string(int(status)));
  }
}

// An allocation of `bytes` failed: says where and how much was free.
[[noreturn]] void throw_out_of_memory(size_t bytes) {
  cudaGetLastError();
  int device = 0;
  size_t free = 0, total = 0;
  cudaGetDevice(&device);
  cudaMemGetInfo(&free, &total);
  throw std::runtime_error("cuda compute: out of memory on CUDA device " + std::to_string(device) +
                           ": " + std::to_string(bytes) + " bytes asked for, " +
                           std::to_string(free) + " of " + std::to_string(total) + " free");
}

// Device memory of `count` elements, freed with it.
template <typename Element>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t count) { resize(count); }
  ~DeviceArray() { release(); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  Element* data() const { return data_; }
  // At least `count` elements, contents undefined. Growing frees the old
  // memory, which cudaFree does only once the device is done with it.
  Element* at_least(size_t count) {
    if (count > count_) resize(count);
    return data_;
  }

 private:
  void resize(size_t count) {
    release();
    const size_t bytes = count * sizeof(Element);
    const cudaError_t status = cudaMalloc(reinterpret_cast<void**>(&data_), bytes);
    if (status == cudaErrorMemoryAllocation) throw_out_of_memory(bytes);
    check(status, "cudaMalloc");
    count_ = count;
  }
  void release() {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    count_ = 0;
  }
  Element* data_ = nullptr;
  size_t count_ = 0;
};

class CudaRotation : public Rotation {
 public:
  CudaRotation(const kernels::RotaryTable<float>& table, cudaStream_t stream)
      : cos_(table.cos.size()),
        sin_(table.sin.size()),
        half_dim_(table.half_dim),
        head_dim_(table.head_dim),
        stream_(stream) {
    const size_t bytes = table.cos.size() * sizeof(float);
    check(cudaMemcpy(cos_.data(), table.cos.data(), bytes, cudaMemcpyHostToDevice), "cos table");
    check(cudaMemcpy(sin_.data(), table.sin.data(), bytes, cudaMemcpyHostToDevice), "sin table");
  }
  void forward(float* x, int64_t batch, int64_t seq_len, int64_t heads,
               int64_t row_stride) const override {
    check(gpu::rotary_forward(x, cos_.data(), sin_.data(), batch, seq_len, heads, head_dim_,
                              half_dim_, row_stride, stream_),
          "rotary_forward");
  }
  void backward(float* dx, int64_t batch, int64_t seq_len, int64_t heads,
                int64_t row_stride) const override {
    check(gpu::rotary_backward(dx, cos_.data(), sin_.data(), batch, seq_len, heads, head_dim_,
                               half_dim_, row_stride, stream_),
          "rotary_backward");
  }

 private:
  DeviceArray<float> cos_, sin_;
  int64_t half_dim_, head_dim_;
  cudaStream_t stream_;
};

class CudaCompute : public Compute {
 public:
  CudaCompute(int device, cudaStream_t stream, MatmulPrecisionSource precision)
      : stream_(stream), precision_(precision), gemms_(workspace_bytes_on(device)) {
    if (!gemms_.ok()) {
      throw std::runtime_error("cuda compute: GPU " + std::to_string(device) +
                               ": no cuBLASLt handle with " + std::to_string(kGemmWorkspaceBytes) +
                               " bytes of workspace (cuBLAS status " +
                               std::to_string(int(gemms_.status())) + ")");
    }
  }

  // Stream-ordered, so memory a call released serves the next allocation
  // once the calls before it are done, without a host wait.
  void* allocate(int64_t bytes) override {
    if (bytes == 0) return nullptr;
    void* memory = nullptr;
    const cudaError_t status = cudaMallocAsync(&memory, size_t(bytes), stream_);
    if (status == cudaErrorMemoryAllocation) throw_out_of_memory(size_t(bytes));
    check(status, "cudaMallocAsync");
    check(cudaMemsetAsync(memory, 0, size_t(bytes), stream_), "allocate's zeroing");
    return memory;
  }
  void release(void* memory) noexcept override {
    if (memory != nullptr) cudaFreeAsync(memory, stream_);
  }
  void copy_bytes(void* to, const void* from, int64_t bytes) override {
    if (bytes == 0) return;
    check(cudaMemcpyAsync(to, from, size_t(bytes), cudaMemcpyDeviceToDevice, stream_),
          "copy_bytes");
  }
  void zero_bytes(void* memory, int64_t bytes) override {
    if (bytes == 0) return;
    check(cudaMemsetAsync(memory, 0, size_t(bytes), stream_), "zero_bytes");
  }
  // Synchronous from pageable memory: the host's buffer may go once it returns.
  void copy_from_host(void* to, const void* host, int64_t bytes) override {
    if (bytes == 0) return;
    check(cudaMemcpyAsync(to, host, size_t(bytes), cudaMemcpyHostToDevice, stream_),
          "copy_from_host");
    check(cudaStreamSynchronize(stream_), "copy_from_host");
  }
  void copy_to_host(void* host, const void* from, int64_t bytes) override {
    if (bytes == 0) return;
    check(cudaMemcpyAsync(host, from, size_t(bytes), cudaMemcpyDeviceToHost, stream_),
          "copy_to_host");
    check(cudaStreamSynchronize(stream_), "copy_to_host");
  }
  void to_bfloat16(uint16_t* bits, const float* values, int64_t count) override {
    check(gpu::to_bfloat16(bits, values, count, stream_), "to_bfloat16");
  }
  void from_bfloat16(float* values, const uint16_t* bits, int64_t count) override {
    check(gpu::from_bfloat16(values, bits, count, stream_), "from_bfloat16");
  }

  // The CPU's GEMM calls of the two layouts (common/layers.hpp), row-major.
  void linear_forward(WeightLayout layout, float* y, const float* x, const Weight<float>& weight,
                      int64_t rows, int64_t in, int64_t out) override {
    if (layout == WeightLayout::out_in) {
      gemm(false, true, rows, out, in, x, in, weight, in, 0.0f, y, out);
    } else {
      gemm(false, false, rows, out, in, x, in, weight, out, 0.0f, y, out);
    }
  }
  void linear_backward_input(WeightLayout layout, float* dx, const float* dy,
                             const Weight<float>& weight, int64_t rows, int64_t in,
                             int64_t out) override {
    if (layout == WeightLayout::out_in) {
      gemm(false, false, rows, in, out, dy, out, weight, in, 0.0f, dx, in);
    } else {
      gemm(false, true, rows, in, out, dy, out, weight, out, 0.0f, dx, in);
    }
  }
  void linear_backward_weight(WeightLayout layout, float* d_weight, const float* dy, const float* x,
                              int64_t rows, int64_t in, int64_t out) override {
    if (layout == WeightLayout::out_in) {
      gemm(true, false, out, in, rows, dy, out, Weight<float>(x), in, 1.0f, d_weight, in);
    } else {
      gemm(true, false, in, out, rows, x, in, Weight<float>(dy), out, 1.0f, d_weight, out);
    }
  }
  void bias_forward(float* y, const float* bias, int64_t rows, int64_t dim) override {
    check(gpu::bias_forward(y, bias, rows, dim, stream_), "bias_forward");
  }
  void bias_backward(float* d_bias, const float* dy, int64_t rows, int64_t dim) override {
    check(gpu::bias_backward(d_bias, dy, rows, dim, stream_), "bias_backward");
  }

  void add(float* out, const float* x, const float* delta, int64_t count) override {
    check(gpu::add(out, x, delta, count, stream_), "add");
  }
  void accumulate(float* sum, const float* addend, int64_t count) override {
    check(gpu::add(sum, sum, addend, count, stream_), "accumulate");
  }
  void copy_rows(float* to, int64_t ld_to, const float* from, int64_t ld_from, int64_t rows,
                 int64_t width) override {
    if (rows == 0 || width == 0) return;
    constexpr size_t kFloat = sizeof(float);
    check(
        cudaMemcpy2DAsync(to, size_t(ld_to) * kFloat, from, size_t(ld_from) * kFloat,
                          size_t(width) * kFloat, size_t(rows), cudaMemcpyDeviceToDevice, stream_),
        "copy_rows");
  }
  void fill(float* values, int64_t count, float value) override {
    check(gpu::fill(values, count, value, stream_), "fill");
  }
  void round_to_bfloat16(float* values, int64_t count) override {
    check(gpu::round_to_bfloat16(values, count, stream_), "round_to_bfloat16");
  }

  void rmsnorm_forward(float* y, float* rstd, const float* x, const float* weight, int64_t rows,
                       int64_t dim, double eps) override {
    check(gpu::rmsnorm_forward(y, rstd, x, weight, rows, dim, eps, stream_), "rmsnorm_forward");
  }
  void rmsnorm_backward(float* dx, float* d_weight, const float* dy, const float* x,
                        const float* weight, const float* rstd, int64_t rows,
                        int64_t dim) override {
    check(gpu::rmsnorm_backward(dx, d_weight, dy, x, weight, rstd, rows, dim, stream_),
          "rmsnorm_backward");
  }
  void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* weight,
                         const float* bias, int64_t rows, int64_t dim, double eps) override {
    check(gpu::layernorm_forward(y, mean, rstd, x, weight, bias, rows, dim, eps, stream_),
          "layernorm_forward");
  }
  void layernorm_backward(float* dx, float* d_weight, float* d_bias, const float* dy,
                          const float* x, const float* weight, const float* mean, const float* rstd,
                          int64_t rows, int64_t dim) override {
    check(gpu::layernorm_backward(dx, d_weight, d_bias, dy, x, weight, mean, rstd, rows, dim,
                                  stream_),
          "layernorm_backward");
  }

  void swiglu_forward(float* out, const float* gate_up, int64_t rows, int64_t dim) override {
    check(gpu::swiglu_forward(out, gate_up, rows, dim, stream_), "swiglu_forward");
  }
  void swiglu_backward(float* d_gate_up, const float* d_out, const float* gate_up, int64_t rows,
                       int64_t dim) override {
    check(gpu::swiglu_backward(d_gate_up, d_out, gate_up, rows, dim, stream_), "swiglu_backward");
  }
  void gelu_forward(float* y, const float* x, int64_t count) override {
    check(gpu::gelu_forward(y, x, count, stream_), "gelu_forward");
  }
  void gelu_backward(float* dx, const float* dy, const float* x, int64_t count) override {
    check(gpu::gelu_backward(dx, dy, x, count, stream_), "gelu_backward");
  }

  void embedding_forward(float* out, const int32_t* indices, const float* table, int64_t rows,
                         int64_t dim, int64_t begin, int64_t size) override {
    check(gpu::embedding_forward(out, indices, table, rows, dim, begin, size, stream_),
          "embedding_forward");
  }
  void embedding_backward(float* d_table, const int32_t* indices, const float* d_out, int64_t rows,
                          int64_t dim, int64_t begin, int64_t size) override {
    check(gpu::embedding_backward(d_table, indices, d_out, rows, dim, begin, size, stream_),
          "embedding_backward");
  }

  // The backward's row dots D_t = dY_t . Y_t [batch, heads, seq].
  int64_t attention_scratch(const kernels::AttentionShape& shape) const override {
    return shape.lse_size();
  }
  void attention_forward(const kernels::AttentionShape& shape, float* out, float* lse,
                         const float* qkv, float* /*scratch*/) override {
    check(gpu::attention_forward(out, lse, qkv, dims_of(shape), stream_), "attention_forward");
  }
  void attention_backward(const kernels::AttentionShape& shape, float* d_qkv, const float* d_out,
                          const float* qkv, const float* out, const float* lse,
                          float* scratch) override {
    check(gpu::attention_backward(d_qkv, scratch, d_out, out, qkv, lse, dims_of(shape), stream_),
          "attention_backward");
  }

  // The kernels keep nothing between calls but what their operands hold.
  int64_t ring_attention_scratch(const kernels::AttentionShape& /*g*/,
                                 int64_t /*chunk*/) const override {
    return 0;
  }
  void ring_attention_merge(const kernels::AttentionShape& g, const kernels::RingBlock& block,
                            float* acc, float* row_max, float* row_sum, const float* qkv,
                            const float* kv, float* /*scratch*/) override {
    check(gpu::ring_attention_merge(acc, row_max, row_sum, qkv, kv, dims_of(g), ring_chunks(block),
                                    stream_),
          "ring_attention_merge");
  }
  void ring_attention_finish(const kernels::AttentionShape& g, float* out, float* lse,
                             const float* row_max, const float* row_sum) override {
    check(gpu::ring_attention_finish(out, lse, row_max, row_sum, dims_of(g), stream_),
          "ring_attention_finish");
  }
  void ring_attention_output_dots(const kernels::AttentionShape& g, float* dots, const float* out,
                                  const float* d_out) override {
    check(gpu::ring_attention_output_dots(dots, out, d_out, dims_of(g), stream_),
          "ring_attention_output_dots");
  }
  void ring_attention_block_backward(const kernels::AttentionShape& g,
                                     const kernels::RingBlock& block, float* d_qkv, float* d_kv,
                                     const float* qkv, const float* kv, const float* d_out,
                                     const float* lse, const float* dots,
                                     float* /*scratch*/) override {
    check(gpu::ring_attention_block_backward(d_qkv, d_kv, qkv, kv, d_out, lse, dots, dims_of(g),
                                             ring_chunks(block), stream_),
          "ring_attention_block_backward");
  }

  double cross_entropy_forward(float* logits, const int32_t* targets, int64_t rows,
                               int64_t vocab) override {
    float* row_loss = row_loss_.at_least(size_t(rows));
    check(gpu::cross_entropy_forward(logits, row_loss, targets, rows, vocab, stream_),
          "cross_entropy_forward");
    return mean_of(row_loss, rows);
  }
  void vocab_parallel_row_max(float* row_max, const float* logits, int64_t rows,
                              int64_t size) override {
    check(gpu::vocab_parallel_row_max(row_max, logits, rows, size, stream_),
          "vocab_parallel_row_max");
  }
  void vocab_parallel_exponentials(float* logits, float* sums, const float* row_max,
                                   const int32_t* targets, int64_t rows, int64_t begin,
                                   int64_t size) override {
    check(gpu::vocab_parallel_exponentials(logits, sums, row_max, targets, rows, begin, size,
                                           stream_),
          "vocab_parallel_exponentials");
  }
  double vocab_parallel_probabilities(float* logits, const float* sums, const float* row_max,
                                      int64_t rows, int64_t size) override {
    float* row_loss = row_loss_.at_least(size_t(rows));
    check(gpu::vocab_parallel_probabilities(logits, row_loss, sums, row_max, rows, size, stream_),
          "vocab_parallel_probabilities");
    return mean_of(row_loss, rows);
  }
  void vocab_parallel_cross_entropy_backward(float* probs, const int32_t* targets, int64_t rows,
                                             int64_t begin, int64_t size, float scale) override {
    check(gpu::vocab_parallel_cross_entropy_backward(probs, targets, rows, begin, size, scale,
                                                     stream_),
          "vocab_parallel_cross_entropy_backward");
  }

  void softmax_rows(float* values, int64_t rows, int64_t columns) override {
    check(gpu::softmax_rows(values, rows, columns, stream_), "softmax_rows");
  }
  void softmax_rows_backward(float* d_values, const float* probs, int64_t rows,
                             int64_t columns) override {
    check(gpu::softmax_rows_backward(d_values, probs, rows, columns, stream_),
          "softmax_rows_backward");
  }
  void moe_route(int32_t* selected, float* weights, const float* probs, int64_t rows,
                 int64_t experts, int64_t top_k) override {
    check(gpu::moe_route(selected, weights, probs, rows, experts, top_k, stream_), "moe_route");
  }
  void moe_order_slots(int64_t* tokens_per_expert, int64_t* slot_position, const int32_t* selected,
                       int64_t rows, int64_t experts, int64_t top_k) override {
    int64_t* on_device = tokens_.at_least(size_t(experts));
    check(gpu::moe_order_slots(on_device, slot_position, selected, rows, experts, top_k, stream_),
          "moe_order_slots");
    to_host(tokens_per_expert, on_device, experts, "the tokens per expert");
  }
  void moe_dispatch(float* slots, const float* x, const int64_t* slot_position, int64_t rows,
                    int64_t top_k, int64_t hidden) override {
    check(gpu::moe_dispatch(slots, x, slot_position, rows, top_k, hidden, stream_), "moe_dispatch");
  }
  void moe_combine(float* y, const float* expert_outputs, const float* weights,
                   const int64_t* slot_position, int64_t rows, int64_t top_k,
                   int64_t hidden) override {
    check(gpu::moe_combine(y, expert_outputs, weights, slot_position, rows, top_k, hidden, stream_),
          "moe_combine");
  }
  void moe_combine_backward(float* d_slots, float* d_weights, const float* dy,
                            const float* expert_outputs, const float* weights,
                            const int64_t* slot_position, int64_t rows, int64_t top_k,
                            int64_t hidden) override {
    check(gpu::moe_combine_backward(d_slots, d_weights, dy, expert_outputs, weights, slot_position,
                                    rows, top_k, hidden, stream_),
          "moe_combine_backward");
  }
  void moe_dispatch_backward(float* dx, const float* d_slots, const int64_t* slot_position,
                             int64_t rows, int64_t top_k, int64_t hidden) override {
    check(gpu::moe_dispatch_backward(dx, d_slots, slot_position, rows, top_k, hidden, stream_),
          "moe_dispatch_backward");
  }
  void column_sums(double* sums, const float* values, int64_t rows, int64_t columns) override {
    double* on_device = sums_.at_least(size_t(columns));
    check(gpu::column_sums(on_device, values, rows, columns, stream_), "column_sums");
    to_host(sums, on_device, columns, "the column sums");
  }
  void moe_router_gradient(float* d_probs, const float* aux_per_token, const float* probs,
                           const int32_t* selected, const float* weights, const float* d_weights,
                           int64_t rows, int64_t experts, int64_t top_k) override {
    // From pageable host memory, cudaMemcpyAsync returns once it has staged
    // the values, so the caller may reuse aux_per_token when this returns.
    float* aux = aux_.at_least(size_t(experts));
    check(cudaMemcpyAsync(aux, aux_per_token, size_t(experts) * sizeof(float),
                          cudaMemcpyHostToDevice, stream_),
          "the load-balancing gradient to the device");
    check(gpu::moe_router_gradient(d_probs, aux, probs, selected, weights, d_weights, rows, experts,
                                   top_k, stream_),
          "moe_router_gradient");
  }

  std::unique_ptr<Rotation> rotation(const kernels::RotaryTable<float>& table) override {
    return std::make_unique<CudaRotation>(table, stream_);
  }

 private:
  // Makes `device` current (the GEMM context is made on it); the bytes of
  // the context's workspace.
  static size_t workspace_bytes_on(int device) {
    check(cudaSetDevice(device), "cudaSetDevice");
    return kGemmWorkspaceBytes;
  }

  // C = op(A) op(B) + beta C as the CPU's gemm: float32, or under the
  // bfloat16 matmul precision each operand rounded to bfloat16 (B's
  // bfloat16 copy read where the weight has one) and the products summed
  // in float32.
  void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a,
            int64_t lda, const Weight<float>& b, int64_t ldb, float beta, float* c, int64_t ldc) {
    if (precision_() == kernels::MatmulPrecision::float32) {
      check(gemms_.gemm_float32(transpose_a, transpose_b, m, n, k, 1.0f, a, lda, b.data, ldb, beta,
                                c, ldc, stream_),
            "gemm_float32");
      return;
    }
    const uint16_t* a_bits = rounded(a, m * k, a_bits_);
    const uint16_t* b_bits = b.bfloat16 != nullptr ? b.bfloat16 : rounded(b.data, k * n, b_bits_);
    check(gemms_.gemm_bfloat16(transpose_a, transpose_b, m, n, k, 1.0f, a_bits, lda, b_bits, ldb,
                               beta, c, ldc, stream_),
          "gemm_bfloat16");
  }

  static gpu::AttentionDims dims_of(const kernels::AttentionShape& shape) {
    return {shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim};
  }
  // Throws when a side spans more chunks than the kernels take (a Ulysses
  // degree above kMaxRingChunks / 2).
  static gpu::RingChunks ring_chunks(const kernels::RingBlock& block) {
    const size_t count = block.query_chunks.size();
    if (count > size_t(gpu::kMaxRingChunks) || block.key_chunks.size() != count) {
      throw std::runtime_error("cuda compute: ring attention over " + std::to_string(count) +
                               " chunks a side; the kernels take at most " +
                               std::to_string(gpu::kMaxRingChunks));
    }
    gpu::RingChunks chunks;
    chunks.chunk = block.chunk;
    chunks.count = int32_t(count);
    std::copy(block.query_chunks.begin(), block.query_chunks.end(), chunks.query);
    std::copy(block.key_chunks.begin(), block.key_chunks.end(), chunks.key);
    return chunks;
  }

  // The mean of the rows' losses, summed in double in row order as the
  // CPU's cross-entropy sums them, once the stream has computed them.
  double mean_of(const float* row_loss, int64_t rows) {
    std::vector<float> losses(static_cast<size_t>(rows));
    to_host(losses.data(), row_loss, rows, "the loss");
    double total = 0;
    for (const float loss : losses) total += double(loss);
    return total / double(rows);
  }

  // count elements from the device to the host, once the stream has
  // computed them.
  template <typename Element>
  void to_host(Element* host, const Element* device, int64_t count, const char* what) {
    check(cudaMemcpyAsync(host, device, size_t(count) * sizeof(Element), cudaMemcpyDeviceToHost,
                          stream_),
          what);
    check(cudaStreamSynchronize(stream_), what);
  }

  // `values` rounded to bfloat16 into `bits` (the stream orders its reuse).
  const uint16_t* rounded(const float* values, int64_t count, DeviceArray<uint16_t>& bits) {
    uint16_t* out = bits.at_least(size_t(count));
    check(gpu::to_bfloat16(values, out, count, stream_), "to_bfloat16");
    return out;
  }

  cudaStream_t stream_;
  MatmulPrecisionSource precision_;
  gpu::GemmContext gemms_;
  DeviceArray<uint16_t> a_bits_, b_bits_;
  DeviceArray<float> row_loss_, aux_;
  DeviceArray<int64_t> tokens_;
  DeviceArray<double> sums_;
};

}  // namespace

std::unique_ptr<Compute> make_cuda_compute(int device, cudaStream_t stream,
                                           MatmulPrecisionSource precision) {
  return std::make_unique<CudaCompute>(device, stream, precision);
}

}  // namespace meshrun::models
