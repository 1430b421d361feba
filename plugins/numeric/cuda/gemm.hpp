// The CUDA twins of numeric/gemm.hpp's GEMMs: operands in bfloat16 or
// float32, products and sums in float32 (cuBLASLt, CUBLAS_COMPUTE_32F), the
// result float32, in the CPU GEMM's row-major convention; and the float32 to
// bfloat16 rounding of numeric/bfloat16.hpp (nearest even). Device
// pointers; every call is enqueued on `stream` and returns without waiting.
//
// This code has compiled but never run on a GPU (docs/testing.md).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace meshrun::kernels::cuda {

// A cuBLASLt handle and the workspace its GEMMs may use. Create one per
// device; calls on it may not run concurrently from two host threads.
class GemmContext {
 public:
  // The handle and `workspace_bytes` of device memory on the current device.
  // Check ok() (a context that failed holds the status) before use.
  explicit GemmContext(size_t workspace_bytes = size_t(32) << 20);
  ~GemmContext();
  GemmContext(const GemmContext&) = delete;
  GemmContext& operator=(const GemmContext&) = delete;

  bool ok() const { return status_ == CUBLAS_STATUS_SUCCESS; }
  cublasStatus_t status() const { return status_; }

  // C = alpha op(A) op(B) + beta C, row-major: op(A) is m x k (A stored
  // k x m when transpose_a), op(B) is k x n (B stored n x k when
  // transpose_b); lda, ldb, ldc are row strides in elements. A and B hold
  // bfloat16 bits. CUBLAS_STATUS_NOT_SUPPORTED when cuBLASLt has no
  // algorithm for the shapes (odd strides: bfloat16 rows want 16-byte
  // alignment, 8 elements).
  cublasStatus_t gemm_bfloat16(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                               float alpha, const uint16_t* a, int64_t lda, const uint16_t* b,
                               int64_t ldb, float beta, float* c, int64_t ldc,
                               cudaStream_t stream) const;
  // The same in float32: operands, products and sums (CUBLAS_COMPUTE_32F,
  // no TF32), as the CPU's float32 GEMM.
  cublasStatus_t gemm_float32(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                              float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                              float beta, float* c, int64_t ldc, cudaStream_t stream) const;

 private:
  // Either, by the operands' type (CUDA_R_16BF or CUDA_R_32F).
  cublasStatus_t matmul(cudaDataType_t operands, bool transpose_a, bool transpose_b, int64_t m,
                        int64_t n, int64_t k, float alpha, const void* a, int64_t lda,
                        const void* b, int64_t ldb, float beta, float* c, int64_t ldc,
                        cudaStream_t stream) const;

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  cublasStatus_t status_ = CUBLAS_STATUS_NOT_INITIALIZED;
};

// out[i] = in[i] rounded to bfloat16 (nearest even; NaN stays NaN).
cudaError_t to_bfloat16(const float* in, uint16_t* out, int64_t count, cudaStream_t stream);

}  // namespace meshrun::kernels::cuda
