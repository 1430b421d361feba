// The matmul precision of the model kernels (distributed.autocast_dtype):
// under bfloat16 every GEMM operand is rounded to bfloat16 and the products
// summed in float32, which a double reference over the rounded operands
// gives to float32's accumulation error (k * 2^-24 of the sum of |products|;
// 1e-5 of it for k = 40 leaves a 20x margin). The same GEMM in float32
// differs from it by bfloat16's rounding (up to 2^-9 relative per operand):
// 1.2e-3 to 2.1e-3 of the sum of |products| at the worst element here, so
// asking for more than 1e-4 tells the two precisions apart. Both hold on
// the CPU's bfloat16 instructions (oneDNN) and on the float32 fallback.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include <catch2/catch.hpp>

#include "common/layers.hpp"
#include "meshrun/dtype.hpp"
#include "numeric/bfloat16.hpp"

namespace {

using meshrun::rounded_to_bfloat16;
using meshrun::kernels::gemm;
using meshrun::kernels::matmul_precision;
using meshrun::kernels::MatmulPrecision;
using meshrun::kernels::MatmulPrecisionScope;

std::vector<float> random_matrix(int64_t rows, int64_t ld, uint32_t seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(size_t(rows * ld));
  for (float& value : values) value = normal(engine);
  return values;
}

// op(X)[i, j] of X stored with row stride ld.
float element(const std::vector<float>& x, int64_t ld, bool transpose, int64_t i, int64_t j) {
  return transpose ? x[size_t(j * ld + i)] : x[size_t(i * ld + j)];
}

struct Product {
  double value = 0, magnitude = 0;  // sum of products, sum of |products|
};

Product reference(const std::vector<float>& a, int64_t lda, bool transpose_a,
                  const std::vector<float>& b, int64_t ldb, bool transpose_b, int64_t i, int64_t j,
                  int64_t k, bool round) {
  Product p;
  for (int64_t l = 0; l < k; ++l) {
    float x = element(a, lda, transpose_a, i, l), y = element(b, ldb, transpose_b, l, j);
    if (round) x = rounded_to_bfloat16(x), y = rounded_to_bfloat16(y);
    p.value += double(x) * double(y);
    p.magnitude += std::abs(double(x) * double(y));
  }
  return p;
}

TEST_CASE("bfloat16 rounding is to nearest even and keeps NaN and infinity", "[layers]") {
  const float ulp_at_one = std::ldexp(1.0f, -7);
  CHECK(rounded_to_bfloat16(1.0f + ulp_at_one / 2) == 1.0f);
  CHECK(rounded_to_bfloat16(1.0f + 1.5f * ulp_at_one) == 1.0f + 2 * ulp_at_one);
  CHECK(rounded_to_bfloat16(1.0f + 0.75f * ulp_at_one) == 1.0f + ulp_at_one);
  CHECK(rounded_to_bfloat16(-3.0f) == -3.0f);
  CHECK(std::isnan(rounded_to_bfloat16(std::numeric_limits<float>::quiet_NaN())));
  CHECK(std::isnan(rounded_to_bfloat16(std::numeric_limits<float>::signaling_NaN())));
  CHECK(rounded_to_bfloat16(std::numeric_limits<float>::infinity()) ==
        std::numeric_limits<float>::infinity());
  CHECK(std::isinf(rounded_to_bfloat16(std::numeric_limits<float>::max())));
}

TEST_CASE("bfloat16 matmuls round every operand and sum in float32", "[layers]") {
  const int64_t m = 7, n = 5, k = 40, pad = 3, ldc = n + 2;
  const bool transpose_a = GENERATE(false, true), transpose_b = GENERATE(false, true);
  // The kernels' uses: a plain product, a scaled one (attention's
  // 1/sqrt(d)) and one accumulated into C (weight gradients).
  const float alpha = GENERATE(1.0f, 0.125f), beta = GENERATE(0.0f, 1.0f);
  CAPTURE(transpose_a, transpose_b, alpha, beta);
  const int64_t lda = (transpose_a ? m : k) + pad, ldb = (transpose_b ? k : n) + pad;
  const auto a = random_matrix(transpose_a ? k : m, lda, 1);
  const auto b = random_matrix(transpose_b ? n : k, ldb, 2);
  const auto c = random_matrix(m, ldc, 3);
  std::vector<float> float32 = c, bfloat16 = c;
  gemm(transpose_a, transpose_b, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, float32.data(),
       ldc);
  {
    MatmulPrecisionScope scope(MatmulPrecision::bfloat16);
    gemm(transpose_a, transpose_b, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta,
         bfloat16.data(), ldc);
  }
  double largest_difference = 0;  // between the two precisions' results
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      const size_t at = size_t(i * ldc + j);
      if (j >= n) {  // past C's columns: untouched
        CHECK(bfloat16[at] == c[at]);
        continue;
      }
      const Product rounded = reference(a, lda, transpose_a, b, ldb, transpose_b, i, j, k, true);
      const Product exact = reference(a, lda, transpose_a, b, ldb, transpose_b, i, j, k, false);
      const double prior = beta * c[at];
      CHECK(std::abs(bfloat16[at] - alpha * rounded.value - prior) <=
            1e-5 * (alpha * rounded.magnitude + std::abs(prior)));
      CHECK(std::abs(float32[at] - alpha * exact.value - prior) <=
            1e-5 * (alpha * exact.magnitude + std::abs(prior)));
      const double difference = std::abs(bfloat16[at] - float32[at]);
      largest_difference = std::max(largest_difference, difference / (alpha * exact.magnitude));
    }
  }
  CHECK(largest_difference > 1e-4);
}

TEST_CASE("a bfloat16 operand is read as it is, and only under bfloat16 matmuls", "[layers]") {
  const int64_t m = 6, n = 5, k = 33, pad = 3, ldc = n;
  const bool transpose_a = GENERATE(false, true), transpose_b = GENERATE(false, true);
  CAPTURE(transpose_a, transpose_b);
  const int64_t lda = (transpose_a ? m : k) + pad, ldb = (transpose_b ? k : n) + pad;
  const auto a = random_matrix(transpose_a ? k : m, lda, 4);
  const auto b = random_matrix(transpose_b ? n : k, ldb, 5);
  // A rounded into bfloat16 once, pad columns included, as attention's
  // sequence copies are.
  std::vector<uint16_t> a16(a.size());
  meshrun::kernels::to_bfloat16(a.data(), a16.data(), int64_t(a.size()));
  const meshrun::kernels::GemmOperand bfloat16_a{nullptr, a16.data(), lda};
  const meshrun::kernels::GemmOperand float32_b{b.data(), nullptr, ldb};
  std::vector<float> c(size_t(m * ldc), 0.0f);
  CHECK_THROWS_AS(
      gemm(transpose_a, transpose_b, m, n, k, 1.0f, bfloat16_a, float32_b, 0.0f, c.data(), ldc),
      std::invalid_argument);
  MatmulPrecisionScope scope(MatmulPrecision::bfloat16);
  gemm(transpose_a, transpose_b, m, n, k, 0.5f, bfloat16_a, float32_b, 0.0f, c.data(), ldc);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const Product rounded = reference(a, lda, transpose_a, b, ldb, transpose_b, i, j, k, true);
      CHECK(std::abs(c[size_t(i * ldc + j)] - 0.5 * rounded.value) <=
            1e-5 * 0.5 * rounded.magnitude);
    }
  }
}

// ctest runs these tests once as they are and once with
// ONEDNN_MAX_CPU_ISA=AVX512_CORE, which withholds the bfloat16 instructions:
// the results above hold for both paths.
TEST_CASE("bfloat16 matmuls use the CPU's bfloat16 instructions where it has them", "[layers]") {
  __builtin_cpu_init();
  const bool withheld = std::getenv("ONEDNN_MAX_CPU_ISA") != nullptr;
  CHECK(meshrun::kernels::bfloat16_matmuls_native() ==
        (__builtin_cpu_supports("avx512bf16") && !withheld));
}

TEST_CASE("a matmul precision scope holds until it ends", "[layers]") {
  CHECK(matmul_precision() == MatmulPrecision::float32);
  {
    MatmulPrecisionScope outer(MatmulPrecision::bfloat16);
    CHECK(matmul_precision() == MatmulPrecision::bfloat16);
    {
      MatmulPrecisionScope inner(MatmulPrecision::float32);
      CHECK(matmul_precision() == MatmulPrecision::float32);
    }
    CHECK(matmul_precision() == MatmulPrecision::bfloat16);
  }
  CHECK(matmul_precision() == MatmulPrecision::float32);
}

}  // namespace
