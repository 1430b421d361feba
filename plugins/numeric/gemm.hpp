// The GEMMs of the shipped models, through oneDNN (docs/decisions.md, "GEMMs
// through oneDNN"): float32, or bfloat16 operands with float32 accumulation
// where the matmul precision says so, and the tests' double GEMM
// (OpenBLAS). A helper library of its own (plugins/numeric) so that every
// model plugin, and the tools that measure the peak these GEMMs reach
// (numeric/peak.hpp), use one copy.
#pragma once

#include <cstdint>

namespace meshrun::kernels {

// What the float GEMMs below compute in. bfloat16 is a matmul under
// torch.autocast("cpu", dtype=torch.bfloat16): each operand rounded to
// bfloat16 (nearest even), the products (exact in float32) and their sums
// in float32, the result float32. It holds for the process: a stage sets it
// for the duration of each forward and backward call with
// MatmulPrecisionScope (every stage of a run computes alike). Not per
// thread: thread-local storage in a dlopen'ed plugin crashed
// LeakSanitizer's tracer at exit.
// The double GEMMs (the tests' references) always compute in double.
enum class MatmulPrecision { float32, bfloat16 };

MatmulPrecision matmul_precision();

// Sets the matmul precision until the scope ends, then restores the last.
class MatmulPrecisionScope {
 public:
  explicit MatmulPrecisionScope(MatmulPrecision precision);
  ~MatmulPrecisionScope();
  MatmulPrecisionScope(const MatmulPrecisionScope&) = delete;
  MatmulPrecisionScope& operator=(const MatmulPrecisionScope&) = delete;

 private:
  MatmulPrecision previous_;
};

// Whether bfloat16 matmuls run on the CPU's bfloat16 instructions
// (AVX512_BF16, through oneDNN); false: they are float32 GEMMs of operands
// rounded to bfloat16, the same numbers at float32's speed.
// ONEDNN_MAX_CPU_ISA=AVX512_CORE (or lower) forces the latter.
bool bfloat16_matmuls_native();

// One OpenBLAS thread unless OPENBLAS_NUM_THREADS says otherwise, and one
// oneDNN (OpenMP) thread for the calling thread unless OMP_NUM_THREADS does:
// the trainer runs one rank per core, its compute on the thread that builds
// the stage.
void use_one_gemm_thread_by_default();

// C[m, n] = alpha * op(A) * op(B) + beta * C, row-major, op(X) = X or X^T;
// lda, ldb, ldc are the row strides of A, B and C as stored. One oneDNN call
// (docs/decisions.md, "GEMMs through oneDNN"): float32, or bfloat16 operands
// with float32 accumulation where the matmul precision says so (beta then
// 0 or 1, as every kernel here uses). The double GEMM is OpenBLAS's.
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc);
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc);

// One operand of the gemm below, as stored with row stride `ld`: float32
// (`data`; a bfloat16 matmul rounds it), or already bfloat16 (`bfloat16`,
// not null; read as it is).
struct GemmOperand {
  const float* data = nullptr;
  const uint16_t* bfloat16 = nullptr;
  int64_t ld = 0;
};

// The float gemm above with operands that may already be bfloat16, so that
// an operand several GEMMs read is rounded once instead of by each (one
// sequence's q, k and v in attention). The same products as the float
// gemm of the operands widened. A bfloat16 operand needs the bfloat16
// matmul precision; under float32 it is refused (std::invalid_argument).
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
          const GemmOperand& a, const GemmOperand& b, float beta, float* c, int64_t ldc);

}  // namespace meshrun::kernels
