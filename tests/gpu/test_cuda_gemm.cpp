// The CUDA twin of the bfloat16 GEMM and of the bfloat16 rounding
// (numeric/cuda/gemm.hpp) against the CPU's (numeric/gemm.hpp,
// numeric/bfloat16.hpp). Without a usable GPU it exits 77 (ctest: skipped).
//
// Rounding: the GPU's bits equal the CPU's for random values, exact ties
// (nearest even), infinities and values that round up to infinity; a NaN
// stays a NaN.
// GEMM: C = 1.5 op(A) op(B) + 0.5 C for the four transpose combinations, A
// and B rounded to bfloat16, against the double GEMM of the same rounded
// values (their products are exact in float32, so only the GPU's float32
// sums differ from it). Tolerance: |gpu - cpu| <= 2e-5 (sum_k |1.5 a b| +
// |0.5 c|): a float32 sum of k = 296 terms errs by at most k 2^-24 ~ 1.8e-5
// of the sum of magnitudes, whatever order or split cuBLASLt adds them in;
// a wrong term is O(1) of it.
//
// This test has compiled but never run on a GPU (docs/testing.md).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "device_buffer.hpp"
#include "numeric/bfloat16.hpp"
#include "numeric/cuda/gemm.hpp"
#include "numeric/gemm.hpp"
#include "usable_devices.hpp"

namespace {

namespace cpu = meshrun::kernels;
namespace gpu = meshrun::kernels::cuda;

int failures = 0;

void require(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  std::fprintf(stderr, "FAIL %s: %s\n", what, cublasLtGetStatusString(status));
  std::exit(1);
}

void check_rounding() {
  std::vector<float> values = random_values(1000, 0.0f, 1.0f, 1);
  const float tie_down = 1.0f + std::ldexp(1.0f, -8);       // halfway, even below
  const float tie_up = 1.0f + 3.0f * std::ldexp(1.0f, -8);  // halfway, even above
  for (const float special :
       {tie_down, -tie_down, tie_up, std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(), 0.0f, -0.0f}) {
    values.push_back(special);
  }
  values.push_back(std::numeric_limits<float>::quiet_NaN());
  std::vector<uint16_t> expected(values.size());
  cpu::to_bfloat16(values.data(), expected.data(), int64_t(values.size()));
  DeviceBuffer<float> in(values);
  DeviceBuffer<uint16_t> out(std::vector<uint16_t>(values.size()));
  require(gpu::to_bfloat16(in.get(), out.get(), int64_t(values.size()), 0), "to_bfloat16");
  const std::vector<uint16_t> got = out.host();
  int wrong = 0;
  for (size_t i = 0; i + 1 < values.size(); ++i) wrong += got[i] != expected[i];
  const bool nan_stays = (got.back() & 0x7f80) == 0x7f80 && (got.back() & 0x7f) != 0;
  std::printf("%s bfloat16 rounding (%d of %zu differ from the CPU's bits; NaN %s)\n",
              wrong == 0 && nan_stays ? "PASS" : "FAIL", wrong, values.size() - 1,
              nan_stays ? "stays NaN" : "lost");
  if (wrong != 0 || !nan_stays) ++failures;
}

void check_gemm(const gpu::GemmContext& context, bool transpose_a, bool transpose_b) {
  constexpr int64_t m = 72, n = 136, k = 296;
  constexpr float alpha = 1.5f, beta = 0.5f;
  const int64_t lda = transpose_a ? m : k, ldb = transpose_b ? k : n;
  std::vector<float> a = random_values(size_t(m * k), 0.0f, 1.0f, 2);
  std::vector<float> b = random_values(size_t(k * n), 0.0f, 1.0f, 3);
  const std::vector<float> c_start = random_values(size_t(m * n), 0.0f, 1.0f, 4);
  cpu::round_to_bfloat16(a.data(), a.data(), int64_t(a.size()));
  cpu::round_to_bfloat16(b.data(), b.data(), int64_t(b.size()));
  std::vector<uint16_t> a_bits(a.size()), b_bits(b.size());
  cpu::to_bfloat16(a.data(), a_bits.data(), int64_t(a.size()));
  cpu::to_bfloat16(b.data(), b_bits.data(), int64_t(b.size()));

  std::vector<double> a64(a.begin(), a.end()), b64(b.begin(), b.end());
  std::vector<double> abs_a(a64.size()), abs_b(b64.size());
  for (size_t i = 0; i < a64.size(); ++i) abs_a[i] = std::abs(a64[i]);
  for (size_t i = 0; i < b64.size(); ++i) abs_b[i] = std::abs(b64[i]);
  std::vector<double> expected(c_start.begin(), c_start.end()), magnitude(size_t(m * n));
  for (size_t i = 0; i < magnitude.size(); ++i) magnitude[i] = std::abs(double(c_start[i]));
  cpu::gemm(transpose_a, transpose_b, m, n, k, double(alpha), a64.data(), lda, b64.data(), ldb,
            double(beta), expected.data(), n);
  cpu::gemm(transpose_a, transpose_b, m, n, k, double(alpha), abs_a.data(), lda, abs_b.data(), ldb,
            double(beta), magnitude.data(), n);

  DeviceBuffer<uint16_t> ga(a_bits), gb(b_bits);
  DeviceBuffer<float> gc(c_start);
  require(context.gemm_bfloat16(transpose_a, transpose_b, m, n, k, alpha, ga.get(), lda, gb.get(),
                                ldb, beta, gc.get(), n, 0),
          "gemm_bfloat16");
  const std::vector<float> got = gc.host();
  double worst = 0;
  bool within = true;
  for (size_t i = 0; i < got.size(); ++i) {
    const double error = std::abs(double(got[i]) - expected[i]);
    worst = std::max(worst, error / magnitude[i]);
    within = within && error <= 2e-5 * magnitude[i];
  }
  std::printf("%s bfloat16 gemm, %s x %s (largest difference %.3g of the sum of magnitudes)\n",
              within ? "PASS" : "FAIL", transpose_a ? "A^T" : "A", transpose_b ? "B^T" : "B",
              worst);
  if (!within) ++failures;
}

}  // namespace

int main() {
  if (!usable_cuda_devices()) return kSkip;
  check_rounding();
  const gpu::GemmContext context;
  require(context.status(), "cublasLtCreate");
  for (const bool transpose_a : {false, true}) {
    for (const bool transpose_b : {false, true}) check_gemm(context, transpose_a, transpose_b);
  }
  std::printf("%d of the CUDA GEMM's checks failed\n", failures);
  return failures == 0 ? 0 : 1;
}
