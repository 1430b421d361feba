// Every shipped layer's backward against central differences of its forward,
// in double precision on random inputs: L = sum(upstream * forward(inputs)),
// so dL/dinputs is exactly what backward computes from `upstream`.
// In double, with eps = 1e-6, the differences are good to ~1e-9 (third
// derivative * eps^2 plus 1e-16 * |L| / eps), so a bound of 1e-7 + 1e-6
// relative leaves a wide margin for rounding yet catches any wrong term.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "common/layers.hpp"
#include "finite_differences.hpp"
#include "llama_reference.hpp"

namespace {

using namespace meshrun::kernels;
using Vector = std::vector<double>;

constexpr double kEps = 1e-6;
constexpr double kAbsTol = 1e-7;
constexpr double kRelTol = 1e-6;

Vector random_vector(int64_t count, uint32_t seed, double scale = 1.0) {
  std::mt19937 engine(seed);
  std::normal_distribution<double> normal(0.0, scale);
  Vector values(count);
  for (double& value : values) value = normal(engine);
  return values;
}

double dot(const Vector& a, const Vector& b) { return llama_reference::dot(a, b); }

// analytic must be dL/dvalues for the current values.
template <typename Loss>
void check_gradient(const char* what, Vector& values, const Vector& analytic, Loss&& loss) {
  REQUIRE(analytic.size() == values.size());
  const Vector numeric =
      finite_differences::central(values.data(), int64_t(values.size()), kEps, loss);
  finite_differences::require_close(what, analytic.data(), numeric, kAbsTol, kRelTol);
}

TEST_CASE("llama embedding backward matches finite differences", "[llama][layers]") {
  const int64_t rows = 6, vocab = 5, dim = 3;
  const std::vector<int32_t> tokens = {4, 1, 4, 0, 2, 4};  // repeats accumulate
  Vector table = random_vector(vocab * dim, 1);
  const Vector upstream = random_vector(rows * dim, 2);
  auto loss = [&] {
    Vector out(rows * dim);
    embedding_forward(out.data(), tokens.data(), table.data(), rows, dim);
    return dot(upstream, out);
  };
  Vector d_table(vocab * dim, 0.0);
  embedding_backward(d_table.data(), tokens.data(), upstream.data(), rows, dim);
  check_gradient("d_table", table, d_table, loss);
}

TEST_CASE("llama linear backward matches finite differences", "[llama][layers]") {
  const int64_t rows = 3, in = 5, out = 4;
  Vector x = random_vector(rows * in, 1), weight = random_vector(out * in, 2);
  const Vector upstream = random_vector(rows * out, 3);
  auto loss = [&] {
    Vector y(rows * out);
    linear_forward(y.data(), x.data(), weight.data(), rows, in, out);
    return dot(upstream, y);
  };
  Vector dx(rows * in), d_weight(out * in, 0.0);
  linear_backward_input(dx.data(), upstream.data(), weight.data(), rows, in, out);
  linear_backward_weight(d_weight.data(), upstream.data(), x.data(), rows, in, out);
  check_gradient("dx", x, dx, loss);
  check_gradient("d_weight", weight, d_weight, loss);
}

TEST_CASE("llama rmsnorm backward matches finite differences", "[llama][layers]") {
  const int64_t rows = 3, dim = 8;
  const double eps = 1e-5;
  Vector x = random_vector(rows * dim, 1), weight = random_vector(dim, 2);
  const Vector upstream = random_vector(rows * dim, 3);
  Vector y(rows * dim), rstd(rows);
  auto loss = [&] {
    rmsnorm_forward(y.data(), rstd.data(), x.data(), weight.data(), rows, dim, eps);
    return dot(upstream, y);
  };
  loss();
  Vector dx(rows * dim, 0.0), d_weight(dim, 0.0);
  rmsnorm_backward(dx.data(), d_weight.data(), upstream.data(), x.data(), weight.data(),
                   rstd.data(), rows, dim);
  check_gradient("dx", x, dx, loss);
  check_gradient("d_weight", weight, d_weight, loss);
}

TEST_CASE("llama rotary embedding follows Hugging Face's rotate_half convention",
          "[llama][layers]") {
  const int64_t seq_len = 6, head_dim = 8;
  const double theta = 10000.0;
  const RotaryTable<double> table(head_dim, seq_len, theta);
  for (int64_t pos = 0; pos < seq_len; ++pos) {
    Vector x = random_vector(head_dim, uint32_t(pos));
    const Vector expected = llama_reference::rotary(x, pos, theta);
    // One "sequence" whose only row sits at position pos: rotate a padded copy.
    Vector padded(seq_len * head_dim, 0.0);
    std::copy(x.begin(), x.end(), padded.begin() + pos * head_dim);
    rotary_forward(padded.data(), table, 1, seq_len, 1, head_dim);
    for (int64_t i = 0; i < head_dim; ++i) {
      CHECK(padded[pos * head_dim + i] == Approx(expected[i]).epsilon(1e-12).margin(1e-12));
    }
  }
}

TEST_CASE("llama rotary backward matches finite differences", "[llama][layers]") {
  const int64_t batch = 2, seq_len = 5, heads = 3, head_dim = 4;
  const int64_t row_stride = heads * head_dim + 2;  // two trailing columns stay untouched
  const RotaryTable<double> table(head_dim, seq_len, 100.0);
  Vector x = random_vector(batch * seq_len * row_stride, 1);
  const Vector upstream = random_vector(x.size(), 2);
  auto loss = [&] {
    Vector rotated = x;
    rotary_forward(rotated.data(), table, batch, seq_len, heads, row_stride);
    return dot(upstream, rotated);
  };
  Vector dx = upstream;
  rotary_backward(dx.data(), table, batch, seq_len, heads, row_stride);
  check_gradient("dx", x, dx, loss);
}

TEST_CASE("llama grouped-query attention backward matches finite differences", "[llama][layers]") {
  const int64_t kv_heads = GENERATE(1, 2, 4);   // multi-query, grouped, multi-head
  const int64_t query_block = GENERATE(2, 64);  // blocks with a short last one; one block
  const AttentionShape shape{2, 5, 4, kv_heads, 4, query_block};
  const int64_t rows = shape.batch * shape.seq_len;
  Vector qkv = random_vector(rows * shape.qkv_dim(), 1);
  const Vector upstream = random_vector(rows * shape.q_dim(), 2);
  Vector out(rows * shape.q_dim());
  Vector lse(shape.lse_size()), scores(shape.seq_len * shape.seq_len);
  auto loss = [&] {
    attention_forward(out.data(), lse.data(), scores.data(), qkv.data(), shape);
    return dot(upstream, out);
  };
  loss();
  AttentionShape one_block = shape;
  one_block.query_block = shape.seq_len;
  Vector one_block_out(out.size()), one_block_lse(lse.size());
  attention_forward(one_block_out.data(), one_block_lse.data(), scores.data(), qkv.data(),
                    one_block);
  for (size_t i = 0; i < out.size(); ++i) REQUIRE(out[i] == Approx(one_block_out[i]).margin(1e-12));
  for (size_t i = 0; i < lse.size(); ++i) REQUIRE(lse[i] == Approx(one_block_lse[i]).margin(1e-12));
  // L_t = log sum_{s <= t} exp(q_t . k_s / sqrt(d)), summed here directly.
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t h = 0; h < shape.heads; ++h) {
      for (int64_t t = 0; t < shape.seq_len; ++t) {
        double sum = 0;
        for (int64_t s = 0; s <= t; ++s) {
          double score = 0;
          for (int64_t i = 0; i < shape.head_dim; ++i) {
            score += qkv[(b * shape.seq_len + t) * shape.qkv_dim() + shape.q_offset(h) + i] *
                     qkv[(b * shape.seq_len + s) * shape.qkv_dim() + shape.k_offset(h) + i];
          }
          sum += std::exp(score / std::sqrt(double(shape.head_dim)));
        }
        const double expected = std::log(sum);
        REQUIRE(lse[size_t((b * shape.heads + h) * shape.seq_len + t)] ==
                Approx(expected).margin(1e-12));
      }
    }
  }
  loss();
  // Backward recomputes the probabilities from the log-sum-exps alone.
  Vector d_qkv(qkv.size()), probs(shape.scores_size()), d_scores(shape.scores_size());
  attention_backward(d_qkv.data(), probs.data(), d_scores.data(), upstream.data(), qkv.data(),
                     lse.data(), shape);
  INFO("kv_heads " << kv_heads << " query_block " << query_block);
  check_gradient("d_qkv", qkv, d_qkv, loss);
}

TEST_CASE("llama swiglu backward matches finite differences", "[llama][layers]") {
  const int64_t rows = 3, dim = 5;
  Vector gate_up = random_vector(rows * 2 * dim, 1, 2.0);
  const Vector upstream = random_vector(rows * dim, 2);
  auto loss = [&] {
    Vector out(rows * dim);
    swiglu_forward(out.data(), gate_up.data(), rows, dim);
    return dot(upstream, out);
  };
  Vector d_gate_up(gate_up.size());
  swiglu_backward(d_gate_up.data(), upstream.data(), gate_up.data(), rows, dim);
  check_gradient("d_gate_up", gate_up, d_gate_up, loss);
}

TEST_CASE("llama cross-entropy backward matches finite differences", "[llama][layers]") {
  const int64_t rows = 4, vocab = 7;
  const std::vector<int32_t> targets = {0, 6, 3, 3};
  const double scale = GENERATE(1.0, 0.25);  // one batch; one of four microbatches
  Vector logits = random_vector(rows * vocab, 1, 2.0);
  auto loss = [&] {
    Vector probs = logits;
    return scale * cross_entropy_forward(probs.data(), targets.data(), rows, vocab);
  };
  Vector d_logits = logits;
  cross_entropy_forward(d_logits.data(), targets.data(), rows, vocab);
  cross_entropy_backward(d_logits.data(), targets.data(), rows, vocab, scale);
  check_gradient("d_logits", logits, d_logits, loss);
}

TEST_CASE("gpt2 conv1d and bias backward match finite differences", "[gpt2][layers]") {
  const int64_t rows = 3, in = 5, out = 4;
  Vector x = random_vector(rows * in, 1), weight = random_vector(in * out, 2);
  Vector bias = random_vector(out, 3);
  const Vector upstream = random_vector(rows * out, 4);
  auto loss = [&] {
    Vector y(rows * out);
    conv1d_forward(y.data(), x.data(), weight.data(), rows, in, out);
    bias_forward(y.data(), bias.data(), rows, out);
    return dot(upstream, y);
  };
  Vector dx(rows * in), d_weight(in * out, 0.0), d_bias(out, 0.0);
  conv1d_backward_input(dx.data(), upstream.data(), weight.data(), rows, in, out);
  conv1d_backward_weight(d_weight.data(), upstream.data(), x.data(), rows, in, out);
  bias_backward(d_bias.data(), upstream.data(), rows, out);
  check_gradient("dx", x, dx, loss);
  check_gradient("d_weight", weight, d_weight, loss);
  check_gradient("d_bias", bias, d_bias, loss);
}

TEST_CASE("gpt2 layernorm backward matches finite differences", "[gpt2][layers]") {
  const int64_t rows = 3, dim = 8;
  const double eps = 1e-5;
  // Rows off zero mean, so that subtracting it matters.
  Vector x = random_vector(rows * dim, 1), weight = random_vector(dim, 2);
  for (double& value : x) value += 0.5;
  Vector bias = random_vector(dim, 3);
  const Vector upstream = random_vector(rows * dim, 4);
  Vector y(rows * dim), mean(rows), rstd(rows);
  auto loss = [&] {
    layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), weight.data(), bias.data(),
                      rows, dim, eps);
    return dot(upstream, y);
  };
  loss();
  Vector dx(rows * dim, 0.0), d_weight(dim, 0.0), d_bias(dim, 0.0);
  layernorm_backward(dx.data(), d_weight.data(), d_bias.data(), upstream.data(), x.data(),
                     weight.data(), mean.data(), rstd.data(), rows, dim);
  check_gradient("dx", x, dx, loss);
  check_gradient("d_weight", weight, d_weight, loss);
  check_gradient("d_bias", bias, d_bias, loss);
}

TEST_CASE("gpt2 gelu_new matches Hugging Face's values, its backward finite differences",
          "[gpt2][layers]") {
  // Inputs across both tails and the bend around 0.
  Vector x = random_vector(12, 1, 2.5);
  const Vector upstream = random_vector(x.size(), 2);
  auto loss = [&] {
    Vector y(x.size());
    gelu_forward(y.data(), x.data(), int64_t(x.size()));
    return dot(upstream, y);
  };
  // Hugging Face's gelu_new at a few points, computed apart in Python.
  const double points[] = {-3.0, -1.0, 0.5, 2.0};
  const double expected[] = {-0.0036373920817729943, -0.15880800939172324, 0.34571400982514394,
                             1.954597694087775};
  for (int i = 0; i < 4; ++i) {
    double value = 0;
    gelu_forward(&value, &points[i], 1);
    CHECK(value == Approx(expected[i]).epsilon(1e-12));
  }
  Vector dx(x.size());
  gelu_backward(dx.data(), upstream.data(), x.data(), int64_t(x.size()));
  check_gradient("dx", x, dx, loss);
}

}  // namespace
