// numeric/cuda/gemm.hpp. Row-major C = op(A) op(B) is, read column-major,
// C^T = op(B)^T op(A)^T: cuBLASLt multiplies B's storage (as its "A") by A's
// (as its "B") into C's, each transposed exactly when the row-major call
// transposes it.
#include <cuda_bf16.h>

#include <algorithm>

#include "numeric/cuda/gemm.hpp"

namespace meshrun::kernels::cuda {

namespace {

// The descriptors of one cuBLASLt call, destroyed with it.
struct Descriptors {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t b_layout = nullptr, a_layout = nullptr, c_layout = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~Descriptors() {
    if (preference != nullptr) cublasLtMatmulPreferenceDestroy(preference);
    if (c_layout != nullptr) cublasLtMatrixLayoutDestroy(c_layout);
    if (a_layout != nullptr) cublasLtMatrixLayoutDestroy(a_layout);
    if (b_layout != nullptr) cublasLtMatrixLayoutDestroy(b_layout);
    if (operation != nullptr) cublasLtMatmulDescDestroy(operation);
  }
};

// A row-major rows x columns matrix with row stride ld, as the column-major
// columns x rows matrix cuBLASLt sees in the same memory.
cublasStatus_t layout_of(cublasLtMatrixLayout_t* layout, cudaDataType_t type, int64_t rows,
                         int64_t columns, int64_t ld) {
  return cublasLtMatrixLayoutCreate(layout, type, uint64_t(columns), uint64_t(rows), ld);
}

__global__ void to_bfloat16_kernel(const float* in, uint16_t* out, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const __nv_bfloat16 rounded = __float2bfloat16_rn(in[i]);
    out[i] = *reinterpret_cast<const uint16_t*>(&rounded);
  }
}

#define MESHRUN_CUBLAS_TRY(call)                                        \
  do {                                                                  \
    const cublasStatus_t status_of_call = (call);                       \
    if (status_of_call != CUBLAS_STATUS_SUCCESS) return status_of_call; \
  } while (false)

}  // namespace

GemmContext::GemmContext(size_t workspace_bytes) {
  status_ = cublasLtCreate(&handle_);
  if (status_ != CUBLAS_STATUS_SUCCESS) return;
  if (workspace_bytes > 0 && cudaMalloc(&workspace_, workspace_bytes) != cudaSuccess) {
    status_ = CUBLAS_STATUS_ALLOC_FAILED;
    return;
  }
  workspace_bytes_ = workspace_bytes;
}

GemmContext::~GemmContext() {
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

cublasStatus_t GemmContext::gemm_bfloat16(bool transpose_a, bool transpose_b, int64_t m, int64_t n,
                                          int64_t k, float alpha, const uint16_t* a, int64_t lda,
                                          const uint16_t* b, int64_t ldb, float beta, float* c,
                                          int64_t ldc, cudaStream_t stream) const {
  return matmul(CUDA_R_16BF, transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                stream);
}

cublasStatus_t GemmContext::gemm_float32(bool transpose_a, bool transpose_b, int64_t m, int64_t n,
                                         int64_t k, float alpha, const float* a, int64_t lda,
                                         const float* b, int64_t ldb, float beta, float* c,
                                         int64_t ldc, cudaStream_t stream) const {
  return matmul(CUDA_R_32F, transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                stream);
}

cublasStatus_t GemmContext::matmul(cudaDataType_t operands, bool transpose_a, bool transpose_b,
                                   int64_t m, int64_t n, int64_t k, float alpha, const void* a,
                                   int64_t lda, const void* b, int64_t ldb, float beta, float* c,
                                   int64_t ldc, cudaStream_t stream) const {
  if (!ok()) return status_;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  Descriptors d;
  MESHRUN_CUBLAS_TRY(cublasLtMatmulDescCreate(&d.operation, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t b_op = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t a_op = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  MESHRUN_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(d.operation, CUBLASLT_MATMUL_DESC_TRANSA, &b_op,
                                                    sizeof(b_op)));
  MESHRUN_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(d.operation, CUBLASLT_MATMUL_DESC_TRANSB, &a_op,
                                                    sizeof(a_op)));
  MESHRUN_CUBLAS_TRY(
      layout_of(&d.b_layout, operands, transpose_b ? n : k, transpose_b ? k : n, ldb));
  MESHRUN_CUBLAS_TRY(
      layout_of(&d.a_layout, operands, transpose_a ? k : m, transpose_a ? m : k, lda));
  MESHRUN_CUBLAS_TRY(layout_of(&d.c_layout, CUDA_R_32F, m, n, ldc));
  MESHRUN_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&d.preference));
  MESHRUN_CUBLAS_TRY(
      cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes_, sizeof(workspace_bytes_)));
  cublasLtMatmulHeuristicResult_t best{};
  int found = 0;
  MESHRUN_CUBLAS_TRY(cublasLtMatmulAlgoGetHeuristic(handle_, d.operation, d.b_layout, d.a_layout,
                                                    d.c_layout, d.c_layout, d.preference, 1, &best,
                                                    &found));
  if (found == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  return cublasLtMatmul(handle_, d.operation, &alpha, b, d.b_layout, a, d.a_layout, &beta, c,
                        d.c_layout, c, d.c_layout, &best.algo, workspace_, workspace_bytes_,
                        stream);
}

cudaError_t to_bfloat16(const float* in, uint16_t* out, int64_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  constexpr int kBlock = 256;
  const int64_t blocks = std::min<int64_t>((count + kBlock - 1) / kBlock, int64_t(1) << 20);
  to_bfloat16_kernel<<<int(blocks), kBlock, 0, stream>>>(in, out, count);
  return cudaGetLastError();
}

}  // namespace meshrun::kernels::cuda
