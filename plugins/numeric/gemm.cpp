#include "numeric/gemm.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <string>
#include <tuple>

#include "meshrun/dtype.hpp"
#include "numeric/bfloat16.hpp"

namespace meshrun::kernels {

namespace {

std::atomic<MatmulPrecision> g_precision{MatmulPrecision::float32};

// One GEMM's operands as oneDNN sees them: row-major logical shapes with the
// caller's strides, a transposed operand being its stored matrix read
// column-major.
struct GemmShape {
  bool transpose_a, transpose_b;
  int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;

  auto key() const {
    return std::tie(transpose_a, transpose_b, m, n, k, lda, ldb, ldc, alpha, beta);
  }
  bool operator<(const GemmShape& other) const { return key() < other.key(); }

  dnnl::memory::desc a(dnnl::memory::data_type type) const {
    return {{m, k}, type, transpose_a ? dnnl::memory::dims{1, lda} : dnnl::memory::dims{lda, 1}};
  }
  dnnl::memory::desc b(dnnl::memory::data_type type) const {
    return {{k, n}, type, transpose_b ? dnnl::memory::dims{1, ldb} : dnnl::memory::dims{ldb, 1}};
  }
  dnnl::memory::desc c() const { return {{m, n}, dnnl::memory::data_type::f32, {ldc, 1}}; }
};

// The operands' stored shapes: op(A) is m x k, op(B) is k x n.
int64_t a_rows(const GemmShape& s) { return s.transpose_a ? s.k : s.m; }
int64_t a_cols(const GemmShape& s) { return s.transpose_a ? s.m : s.k; }
int64_t b_rows(const GemmShape& s) { return s.transpose_b ? s.n : s.k; }
int64_t b_cols(const GemmShape& s) { return s.transpose_b ? s.k : s.n; }

// `out` holding at least `size` elements, grown when it holds fewer; its
// contents are left uninitialized: the callers write every element they read.
template <typename Element>
Element* grown(std::unique_ptr<Element[]>& out, size_t& capacity, size_t size) {
  if (size > capacity) {
    out.reset(new Element[size]);
    capacity = size;
  }
  return out.get();
}

// The rows x cols matrix of `x` (row stride x.ld) in bfloat16, at the top
// left of a padded_rows x padded_cols one of zeros, in `out` (row stride
// padded_cols), which grows as needed.
const uint16_t* bfloat16_copy(const GemmOperand& x, int64_t rows, int64_t cols, int64_t padded_rows,
                              int64_t padded_cols, std::unique_ptr<uint16_t[]>& out,
                              size_t& capacity) {
  const auto size = size_t(padded_rows * padded_cols);
  uint16_t* copy = grown(out, capacity, size);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* row = copy + r * padded_cols;
    if (x.bfloat16 != nullptr) {
      std::copy_n(x.bfloat16 + r * x.ld, cols, row);
    } else {
      to_bfloat16(x.data + r * x.ld, row, cols);
    }
    std::fill(row + cols, row + padded_cols, uint16_t{0});
  }
  std::fill(copy + rows * padded_cols, copy + size, uint16_t{0});
  return copy;
}

// The rows x cols matrix of `x` (row stride x.ld) rounded to bfloat16 and
// held in float32, in `out` (row stride cols), which grows as needed.
const float* rounded_copy(const GemmOperand& x, int64_t rows, int64_t cols,
                          std::unique_ptr<float[]>& out, size_t& capacity) {
  float* copy = grown(out, capacity, size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    if (x.bfloat16 != nullptr) {
      from_bfloat16(x.bfloat16 + r * x.ld, copy + r * cols, cols);
    } else {
      round_to_bfloat16(x.data + r * x.ld, copy + r * cols, cols);
    }
  }
  return copy;
}

// Scratch for the two operands of one GEMM, kept between calls: a step's
// GEMMs reuse it instead of allocating (and zeroing) their copies anew.
template <typename Element>
struct OperandCopies {
  std::unique_ptr<Element[]> a, b;
  size_t a_capacity = 0, b_capacity = 0;
};

// oneDNN's bfloat16 matmul (bfloat16 operands, float32 accumulation and
// result): C = alpha * op(A) op(B) + beta * C, beta 0 or 1 (a sum post-op).
// A primitive is JIT-compiled per shape, so they are kept with their memory
// objects: a training step repeats a few dozen shapes, and attention's
// small GEMMs would otherwise spend more time being set up than computing.
// Calls are serialized (one compute thread per rank is the norm).
class BfloatMatmuls {
 public:
  static BfloatMatmuls& instance() {
    static BfloatMatmuls matmuls;
    return matmuls;
  }

  // op(A) and op(B) of `shape`, with m and k rounded up to multiples of
  // kShapeQuantum: a bfloat16 operand that needs no padding is read where
  // it is, the others are copied into zero-padded bfloat16 buffers, and C
  // is computed into a padded float32 one (holding C's rows first when
  // beta = 1) when m is padded, then copied back.
  void run(const GemmShape& shape, const GemmOperand& a, const GemmOperand& b, float* c) {
    const std::lock_guard<std::mutex> lock(mutex_);
    GemmShape padded = shape;
    padded.m = rounded_up(shape.m);
    padded.k = rounded_up(shape.k);
    const bool same_size = padded.m == shape.m && padded.k == shape.k;
    const uint16_t* a16 = a.bfloat16;
    if (a16 == nullptr || !same_size) {
      a16 = bfloat16_copy(a, a_rows(shape), a_cols(shape), a_rows(padded), a_cols(padded),
                          copies_.a, copies_.a_capacity);
      padded.lda = a_cols(padded);
    }
    const uint16_t* b16 = b.bfloat16;
    if (b16 == nullptr || !same_size) {
      b16 = bfloat16_copy(b, b_rows(shape), b_cols(shape), b_rows(padded), b_cols(padded),
                          copies_.b, copies_.b_capacity);
      padded.ldb = b_cols(padded);
    }
    if (padded.m == shape.m) {
      execute(padded, a16, b16, c);
      return;
    }
    padded.ldc = shape.n;
    float* padded_c = grown(padded_c_, c_capacity_, size_t(padded.m * shape.n));
    if (shape.beta != 0.0f) {
      for (int64_t r = 0; r < shape.m; ++r) {
        std::copy_n(c + r * shape.ldc, shape.n, padded_c + r * shape.n);
      }
    }
    execute(padded, a16, b16, padded_c);
    for (int64_t r = 0; r < shape.m; ++r) {
      std::copy_n(padded_c + r * shape.n, shape.n, c + r * shape.ldc);
    }
  }

 private:
  // A primitive is compiled per shape, and the experts of a mixture see a
  // new number of rows (m, and k for their weight gradients) in nearly
  // every GEMM: Mixtral-like runs compiled about 55 primitives a rank a
  // step, each 0.15-0.36 ms, and the cache kept growing. Rounded up to a
  // multiple of 16 (zero rows and columns, which add nothing), a run meets
  // a bounded set of shapes.
  static constexpr int64_t kShapeQuantum = 16;

  static int64_t rounded_up(int64_t size) {
    return (size + kShapeQuantum - 1) / kShapeQuantum * kShapeQuantum;
  }

  void execute(const GemmShape& shape, const uint16_t* a16, const uint16_t* b16, float* c) {
    Primitive& primitive = find(shape);
    primitive.a.set_data_handle(const_cast<uint16_t*>(a16));
    primitive.b.set_data_handle(const_cast<uint16_t*>(b16));
    primitive.c.set_data_handle(c);
    primitive.matmul.execute(stream_, {{DNNL_ARG_SRC, primitive.a},
                                       {DNNL_ARG_WEIGHTS, primitive.b},
                                       {DNNL_ARG_DST, primitive.c}});
    stream_.wait();
  }

  struct Primitive {
    dnnl::matmul matmul;
    dnnl::memory a, b, c;
  };

  BfloatMatmuls() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}

  Primitive& find(const GemmShape& shape) {
    auto found = primitives_.find(shape);
    if (found != primitives_.end()) return found->second;
    if (shape.beta != 0.0f && shape.beta != 1.0f) {
      throw std::invalid_argument("bfloat16 gemm: beta must be 0 or 1");
    }
    dnnl::primitive_attr attributes;
    if (shape.alpha != 1.0f) attributes.set_output_scales(0, {shape.alpha});
    if (shape.beta == 1.0f) {
      dnnl::post_ops accumulate;
      accumulate.append_sum(1.0f);
      attributes.set_post_ops(accumulate);
    }
    using type = dnnl::memory::data_type;
    const dnnl::memory::desc a = shape.a(type::bf16), b = shape.b(type::bf16), c = shape.c();
    const dnnl::matmul::primitive_desc chosen(dnnl::matmul::desc(a, b, c), attributes, engine_);
    Primitive primitive{dnnl::matmul(chosen), dnnl::memory(a, engine_, DNNL_MEMORY_NONE),
                        dnnl::memory(b, engine_, DNNL_MEMORY_NONE),
                        dnnl::memory(c, engine_, DNNL_MEMORY_NONE)};
    return primitives_.emplace(shape, std::move(primitive)).first->second;
  }

  dnnl::engine engine_;
  dnnl::stream stream_;
  std::mutex mutex_;
  std::map<GemmShape, Primitive> primitives_;
  OperandCopies<uint16_t> copies_;
  std::unique_ptr<float[]> padded_c_;
  size_t c_capacity_ = 0;
};

// Whether oneDNN may use the CPU's bfloat16 instructions (AVX512_BF16 or
// newer; ONEDNN_MAX_CPU_ISA can withhold them). Decided once: the ISA
// oneDNN may use does not change in a process.
bool native_bfloat16() {
  static const bool native = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
    return (isa & bf16) == bf16;
  }();
  return native;
}

void float_gemm(const GemmShape& s, const float* a, const float* b, float* c) {
  const dnnl_status_t status = dnnl_sgemm(s.transpose_a ? 'T' : 'N', s.transpose_b ? 'T' : 'N', s.m,
                                          s.n, s.k, s.alpha, a, s.lda, b, s.ldb, s.beta, c, s.ldc);
  if (status != dnnl_success) {
    throw std::runtime_error("dnnl_sgemm failed (status " + std::to_string(int(status)) + ")");
  }
}

void bfloat16_gemm(GemmShape s, const GemmOperand& a, const GemmOperand& b, float* c) {
  if (native_bfloat16()) {
    BfloatMatmuls::instance().run(s, a, b, c);
    return;
  }
  // Widening a bfloat16 is exact, so float32 products of the rounded
  // copies are the bfloat16 products.
  OperandCopies<float> copies;
  const float* rounded_a = rounded_copy(a, a_rows(s), a_cols(s), copies.a, copies.a_capacity);
  const float* rounded_b = rounded_copy(b, b_rows(s), b_cols(s), copies.b, copies.b_capacity);
  s.lda = a_cols(s);
  s.ldb = b_cols(s);
  float_gemm(s, rounded_a, rounded_b, c);
}

}  // namespace

void use_one_gemm_thread_by_default() {
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) openblas_set_num_threads(1);
  if (std::getenv("OMP_NUM_THREADS") == nullptr) omp_set_num_threads(1);
}

MatmulPrecision matmul_precision() { return g_precision.load(std::memory_order_relaxed); }

MatmulPrecisionScope::MatmulPrecisionScope(MatmulPrecision precision)
    : previous_(g_precision.exchange(precision, std::memory_order_relaxed)) {}

MatmulPrecisionScope::~MatmulPrecisionScope() {
  g_precision.store(previous_, std::memory_order_relaxed);
}

bool bfloat16_matmuls_native() { return native_bfloat16(); }

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  const GemmShape shape{transpose_a, transpose_b, m, n, k, lda, ldb, ldc, alpha, beta};
  if (matmul_precision() == MatmulPrecision::bfloat16 && k > 0) {
    bfloat16_gemm(shape, {a, nullptr, lda}, {b, nullptr, ldb}, c);
  } else {
    float_gemm(shape, a, b, c);
  }
}

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
          const GemmOperand& a, const GemmOperand& b, float beta, float* c, int64_t ldc) {
  if (a.bfloat16 == nullptr && b.bfloat16 == nullptr) {
    gemm(transpose_a, transpose_b, m, n, k, alpha, a.data, a.ld, b.data, b.ld, beta, c, ldc);
    return;
  }
  if (matmul_precision() != MatmulPrecision::bfloat16) {
    throw std::invalid_argument("gemm: a bfloat16 operand under float32 matmul precision");
  }
  if (m == 0 || n == 0) return;
  const GemmShape shape{transpose_a, transpose_b, m, n, k, a.ld, b.ld, ldc, alpha, beta};
  if (k > 0) {
    bfloat16_gemm(shape, a, b, c);
  } else if (beta == 0.0f) {
    for (int64_t r = 0; r < m; ++r) std::fill_n(c + r * ldc, n, 0.0f);
  }
}

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  const auto op = [](bool transpose) { return transpose ? CblasTrans : CblasNoTrans; };
  cblas_dgemm(CblasRowMajor, op(transpose_a), op(transpose_b), int(m), int(n), int(k), alpha, a,
              int(lda), b, int(ldb), beta, c, int(ldc));
}

}  // namespace meshrun::kernels
