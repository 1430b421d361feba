#include "common/layers.hpp"

#include <cblas.h>

namespace meshrun::kernels {

namespace {

CBLAS_TRANSPOSE op(bool transpose) { return transpose ? CblasTrans : CblasNoTrans; }

}  // namespace

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
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
