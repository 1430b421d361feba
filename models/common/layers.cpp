#include "common/layers.hpp"

#include <cblas.h>

#include <atomic>

#include "tensor/elements.hpp"

namespace meshrun::kernels {

namespace {

std::atomic<MatmulPrecision> g_precision{MatmulPrecision::float32};

CBLAS_TRANSPOSE op(bool transpose) { return transpose ? CblasTrans : CblasNoTrans; }

// The rows x cols matrix stored at x with row stride ld, each element
// rounded to bfloat16 and widened back, packed into `packed` (row stride
// cols). Widening is exact, so float32 products of the copies are the
// bfloat16 products.
const float* packed_bfloat16(const float* x, int64_t rows, int64_t cols, int64_t ld,
                             std::vector<float>& packed) {
  packed.resize(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * ld;
    float* out = packed.data() + r * cols;
    for (int64_t c = 0; c < cols; ++c) out[c] = rounded_to_bfloat16(row[c]);
  }
  return packed.data();
}

}  // namespace

MatmulPrecision matmul_precision() { return g_precision.load(std::memory_order_relaxed); }

MatmulPrecisionScope::MatmulPrecisionScope(MatmulPrecision precision)
    : previous_(g_precision.exchange(precision, std::memory_order_relaxed)) {}

MatmulPrecisionScope::~MatmulPrecisionScope() {
  g_precision.store(previous_, std::memory_order_relaxed);
}

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  std::vector<float> packed_a, packed_b;
  if (matmul_precision() == MatmulPrecision::bfloat16) {
    const int64_t a_cols = transpose_a ? m : k, b_cols = transpose_b ? k : n;
    a = packed_bfloat16(a, transpose_a ? k : m, a_cols, lda, packed_a);
    b = packed_bfloat16(b, transpose_b ? n : k, b_cols, ldb, packed_b);
    lda = a_cols;
    ldb = b_cols;
  }
  cblas_sgemm(CblasRowMajor, op(transpose_a), op(transpose_b), int(m), int(n), int(k), alpha, a,
              int(lda), b, int(ldb), beta, c, int(ldc));
}

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  cblas_dgemm(CblasRowMajor, op(transpose_a), op(transpose_b), int(m), int(n), int(k), alpha, a,
              int(lda), b, int(ldb), beta, c, int(ldc));
}

}  // namespace meshrun::kernels
