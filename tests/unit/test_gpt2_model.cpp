// The GPT-2 model library (models/gpt2): Hugging Face names and shapes; the
// loss against a naive double-precision re-implementation of
// GPT2LMHeadModel (gpt2_reference.hpp), tied and untied; every parameter's
// gradient against finite differences of that reference; hooks in the
// documented order; storage bound by the hooks; stages of a pipeline,
// microbatches in flight and split backwards computing exactly what the
// whole model does; Hugging Face's initialization.
//
// Tolerances:
// - the loss, float32 against double: rounding leaves ~1e-7 relative; a
//   wrong convention (Conv1D layout, head split, scale, variance, GELU
//   variant, positions) moves the loss by far more than the bound, 1e-5
//   relative. Seen: at most 9.5e-8.
// - gradients against central differences of the double reference (eps
//   1e-6, accurate to ~1e-9): float32 rounding of the backward leaves a few
//   1e-7 on these weights (gradients up to ~1), so 1e-5 absolute + 1e-4
//   relative keeps a margin of over 10x and still catches any wrong term.
//   Seen: at most 3.4e-7 absolute.
// - stages, microbatches and split backwards run the same kernels on the
//   same shapes in the same order as the whole model: equal bit for bit.
// - initialization: pooled over the c_proj weights (n = 40960) and over the
//   other matrices (n ~ 70000), the sample standard deviation's relative
//   standard error is 1/sqrt(2n) < 0.4%, so 1.5% is over 4 of them, and the
//   two groups' deviations differ by 4x; the mean is within 5 standard
//   errors of 0.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "finite_differences.hpp"
#include "gpt2/model.hpp"
#include "gpt2/stage.hpp"
#include "gpt2_reference.hpp"
#include "model_checks.hpp"
#include "stage_fixture.hpp"

namespace gpt2_model_test {

using Catch::Matchers::Contains;
using meshrun::gpt2::Gpt2;
using meshrun::gpt2::Gpt2Config;
using meshrun::gpt2::ParameterView;
using meshrun::gpt2::StageLayout;
using stage_fixture::Batch;
using stage_fixture::random_batch;
using Gpt2Model = stage_fixture::OwnedModel<Gpt2>;
using Chain = stage_fixture::Chain<Gpt2>;

constexpr int64_t kGpt2Batch = 2;
constexpr int64_t kGpt2SeqLen = 5;

// head_dim 2, n_inner apart from 4 n_embd, and few positions beyond
// seq_len: every parameter kind, small enough for finite differences of
// every entry.
Gpt2Config narrow_config(bool tied) {
  Gpt2Config config;
  config.vocab_size = 11;
  config.n_positions = 7;
  config.n_embd = 8;
  config.n_layer = 2;
  config.n_head = 4;
  config.n_inner = 12;
  config.tie_word_embeddings = tied;
  return config;
}

// head_dim 8 over two heads.
Gpt2Config wide_config() {
  Gpt2Config config = narrow_config(false);
  config.n_embd = 16;
  config.n_head = 2;
  config.n_inner = 64;
  return config;
}

// Four blocks to split over stages.
Gpt2Config four_block_config(bool tied) {
  Gpt2Config config = narrow_config(tied);
  config.n_layer = 4;
  return config;
}

// Weights far from the 0.02 initialization, so attention is peaked rather
// than uniform and every convention shows in the loss; LayerNorm weights
// away from 1 and biases away from 0 so their gradients are not degenerate.
void randomize(Gpt2Model& model, uint32_t seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (ParameterView& view : model.parameters()) {
    const bool norm_weight = view.shape.size() == 1 &&
                             view.name.find(".ln_") != std::string::npos &&
                             view.name.ends_with(".weight");
    const bool embedding = view.name.rfind("transformer.w", 0) == 0;
    const float scale = embedding ? 1.0f : view.shape.size() == 1 ? 0.2f : 0.3f;
    for (int64_t i = 0; i < view.numel; ++i) {
      view.data[i] = (norm_weight ? 1.0f : 0.0f) + scale * normal(engine);
    }
  }
}

// The reference loss of a batch [kGpt2Batch, kGpt2SeqLen] from weights by name.
auto reference_of(const Gpt2Config& config) {
  return [config](const reference::Weights& weights, const Batch& batch) {
    return gpt2_reference::loss(config, weights, batch.tokens.data(), batch.targets.data(),
                                kGpt2Batch, kGpt2SeqLen);
  };
}

float forward_backward(Gpt2Model& model, const Batch& batch) {
  const float loss =
      model.forward(batch.tokens.data(), batch.targets.data(), kGpt2Batch, kGpt2SeqLen);
  model.backward();
  return loss;
}

TEST_CASE("gpt2 parameters: Hugging Face names, shapes and order, units by block", "[gpt2]") {
  const bool tied = GENERATE(false, true);
  const auto parameters = meshrun::gpt2::model_parameters(narrow_config(tied));
  const int64_t V = 11, P = 7, E = 8, I = 12;
  model_checks::NamedShapes expected = {{"transformer.wte.weight", {V, E}},
                                        {"transformer.wpe.weight", {P, E}}};
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "transformer.h." + std::to_string(layer) + ".";
    expected.insert(expected.end(), {{p + "ln_1.weight", {E}},
                                     {p + "ln_1.bias", {E}},
                                     {p + "attn.c_attn.weight", {E, 3 * E}},
                                     {p + "attn.c_attn.bias", {3 * E}},
                                     {p + "attn.c_proj.weight", {E, E}},
                                     {p + "attn.c_proj.bias", {E}},
                                     {p + "ln_2.weight", {E}},
                                     {p + "ln_2.bias", {E}},
                                     {p + "mlp.c_fc.weight", {E, I}},
                                     {p + "mlp.c_fc.bias", {I}},
                                     {p + "mlp.c_proj.weight", {I, E}},
                                     {p + "mlp.c_proj.bias", {E}}});
  }
  expected.insert(expected.end(),
                  {{"transformer.ln_f.weight", {E}}, {"transformer.ln_f.bias", {E}}});
  if (!tied) expected.push_back({"lm_head.weight", {V, E}});

  // Two layers: the embedding is unit 2 (wte in the root, 4, when tied), the head 3.
  model_checks::check_parameter_list(parameters, expected, "transformer.h.",
                                     {{"transformer.wte.weight", tied ? 4 : 2},
                                      {"transformer.wpe.weight", 2},
                                      {"transformer.ln_f.weight", 3},
                                      {"transformer.ln_f.bias", 3},
                                      {"lm_head.weight", 3}});
}

TEST_CASE("gpt2 forward matches a naive double-precision Hugging Face reference", "[gpt2]") {
  const Gpt2Config config = GENERATE(narrow_config(false), narrow_config(true), wide_config());
  INFO("n_embd " << config.n_embd << " tied " << config.tie_word_embeddings);
  Gpt2Model model(config);
  randomize(model, 1);
  const Batch batch = random_batch(config.vocab_size, kGpt2Batch, kGpt2SeqLen, 2);
  const double expected = reference_of(config)(reference::weights_of(model.parameters()), batch);
  CHECK(model.forward(batch.tokens.data(), batch.targets.data(), kGpt2Batch, kGpt2SeqLen) ==
        Approx(expected).epsilon(1e-5));
}

TEST_CASE("gpt2 gradients of every parameter match finite differences of the reference", "[gpt2]") {
  const Gpt2Config config = GENERATE(narrow_config(false), narrow_config(true));
  INFO("tied " << config.tie_word_embeddings);
  Gpt2Model model(config);
  randomize(model, 3);
  model_checks::check_gradients(model, random_batch(config.vocab_size, kGpt2Batch, kGpt2SeqLen, 4),
                                kGpt2Batch, kGpt2SeqLen, reference_of(config), 1e-5, 1e-4);
}

TEST_CASE("gpt2 calls the hooks in the documented order, gradients final when announced",
          "[gpt2]") {
  const bool tied = GENERATE(false, true);
  Gpt2Model model(narrow_config(tied));
  randomize(model, 5);
  stage_fixture::RecordingHooks<Gpt2> hooks(model);
  model.set_observer(&hooks);
  forward_backward(model, random_batch(11, kGpt2Batch, kGpt2SeqLen, 6));
  stage_fixture::check_documented_order(hooks, model);
}

TEST_CASE("gpt2 computes the same with units bound to storage that comes and goes", "[gpt2]") {
  const bool tied = GENERATE(false, true);
  Gpt2Model owning(narrow_config(tied));
  randomize(owning, 7);
  stage_fixture::check_unit_storage(owning, random_batch(11, kGpt2Batch, kGpt2SeqLen, 8),
                                    kGpt2Batch, kGpt2SeqLen);
}

// Even split of 4 blocks over 3 stages (remainder to the first); a stage of
// the embeddings alone and one of the head alone; one stage of everything.
std::vector<std::vector<StageLayout>> splits() {
  return {{{0, 2, true, false}, {2, 3, false, false}, {3, 4, false, true}},
          {{0, 0, true, false}, {0, 4, false, false}, {4, 4, false, true}},
          {{0, 4, true, true}}};
}

std::vector<Batch> random_batches(int count) {
  std::vector<Batch> batches;
  for (int mb = 0; mb < count; ++mb)
    batches.push_back(random_batch(11, kGpt2Batch, kGpt2SeqLen, 100 + mb));
  return batches;
}

// The splits, and one stage of the whole model with tied embeddings.
struct ChainCase {
  bool tied;
  std::vector<StageLayout> layouts;
};

std::vector<ChainCase> chain_cases() {
  std::vector<ChainCase> cases;
  for (const auto& layouts : splits()) cases.push_back({false, layouts});
  cases.push_back({true, splits()[2]});
  return cases;
}

TEST_CASE("gpt2 stages in a chain give exactly the model's loss and gradients", "[gpt2][stage]") {
  const ChainCase chain_case = GENERATE(from_range(chain_cases()));
  INFO("stages " << chain_case.layouts.size() << ", first ends at block "
                 << chain_case.layouts[0].end_layer << ", tied " << chain_case.tied);
  Gpt2Model model(four_block_config(chain_case.tied));
  randomize(model, 9);
  const Batch batch = random_batch(11, kGpt2Batch, kGpt2SeqLen, 10);
  const float expected = forward_backward(model, batch);

  Chain chain(model, chain_case.layouts, kGpt2Batch, kGpt2SeqLen);
  CHECK(chain.run("F0 B0", {batch}, 1.0f).at(0) == expected);
  CHECK(chain.gradients() == stage_fixture::gradients_of(model.parameters()));
}

// Each gradient receives the microbatches' contributions in the same order
// (0, 1, 2, 3) in both schedules, so the sums are equal bit for bit.
TEST_CASE("gpt2 stages with microbatches in flight and split backwards accumulate as one at a time",
          "[gpt2][stage]") {
  Gpt2Model model(four_block_config(false));
  randomize(model, 11);
  const std::vector<Batch> batches = random_batches(4);
  Chain one_by_one(model, splits()[0], kGpt2Batch, kGpt2SeqLen);
  const auto expected_losses = one_by_one.run("F0 B0 F1 B1 F2 B2 F3 B3", batches, 0.25f);

  Chain interleaved(model, splits()[0], kGpt2Batch, kGpt2SeqLen);
  CHECK(interleaved.run("F0 F1 I0 F2 I1 W0 F3 I2 W1 W2 B3", batches, 0.25f) == expected_losses);
  CHECK(interleaved.gradients() == one_by_one.gradients());
  CHECK(interleaved.activation_bytes() == 0);
}

TEST_CASE("gpt2 stages checkpointing blocks give exactly the results of keeping them",
          "[gpt2][stage]") {
  Gpt2Model model(four_block_config(false));
  randomize(model, 14);
  stage_fixture::check_checkpointing_is_exact(model, splits()[0], random_batches(4), kGpt2Batch,
                                              kGpt2SeqLen);
}

// A tied lm_head adds to wte's gradient in the weight pass, after the
// embedding's share from the input pass: the same sum in another order, so
// wte's gradient agrees to float32 rounding (1e-6 of its largest entry;
// seen: at most 6e-8 absolute) and every other one bit for bit.
TEST_CASE("gpt2 tied lm_head: a split backward gives the full backward's gradients",
          "[gpt2][stage]") {
  Gpt2Model model(four_block_config(true));
  randomize(model, 12);
  const std::vector<Batch> batches = random_batches(2);
  Chain full(model, splits()[2], kGpt2Batch, kGpt2SeqLen),
      split(model, splits()[2], kGpt2Batch, kGpt2SeqLen);
  full.run("F0 B0 F1 B1", batches, 0.5f);
  split.run("F0 F1 I0 I1", batches, 0.5f);
  const ParameterView& wte = split.owned(0).parameters()[0];
  std::vector<float> before_weight_pass(wte.grad, wte.grad + wte.numel);
  split.run("W0 W1", batches, 0.5f);
  CHECK_FALSE(std::equal(before_weight_pass.begin(), before_weight_pass.end(), wte.grad));

  stage_fixture::Gradients expected = full.gradients(), actual = split.gradients();
  const std::vector<float>& expected_wte = expected.at("transformer.wte.weight");
  float scale = 0;
  for (float g : expected_wte) scale = std::max(scale, std::abs(g));
  finite_differences::require_close(
      "transformer.wte.weight", actual.at("transformer.wte.weight").data(),
      std::vector<double>(expected_wte.begin(), expected_wte.end()), 1e-6 * scale, 0.0);
  expected.erase("transformer.wte.weight");
  actual.erase("transformer.wte.weight");
  CHECK(actual == expected);
}

// The sample mean and standard deviation of values pooled over tensors.
struct Moments {
  void add(const float* values, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      sum += values[i];
      sum_squares += double(values[i]) * values[i];
    }
    n += count;
  }
  double mean() const { return sum / double(n); }
  double stddev() const { return std::sqrt(sum_squares / double(n) - mean() * mean()); }

  double sum = 0, sum_squares = 0;
  int64_t n = 0;
};

TEST_CASE("gpt2 initialization: Hugging Face's distributions, the same per seed and alone",
          "[gpt2]") {
  Gpt2Config config = narrow_config(false);  // matrices large enough for statistics
  config.vocab_size = 256;
  config.n_positions = 64;
  config.n_embd = 32;
  config.n_inner = 128;
  config.n_layer = 8;
  config.initializer_range = GENERATE(0.02, 0.05);
  Gpt2Model model(config);
  model.init_weights(42);
  const auto all = meshrun::gpt2::model_parameters(config);
  Moments scaled, unscaled;  // the c_proj weights, the other matrices
  for (const ParameterView& view : model.parameters()) {
    INFO(view.name);
    if (view.shape.size() == 1) {
      const float expected = view.name.ends_with(".weight") ? 1.0f : 0.0f;  // LayerNorm weights
      CHECK(std::all_of(view.data, view.data + view.numel, [&](float w) { return w == expected; }));
    } else {
      (view.name.ends_with("c_proj.weight") ? scaled : unscaled).add(view.data, view.numel);
    }
    std::vector<float> alone(size_t(view.numel));
    meshrun::gpt2::init_parameter(config, all, 42, view.index, alone.data());
    CHECK(std::equal(alone.begin(), alone.end(), view.data));
  }
  const double range = config.initializer_range;
  for (const auto& [moments, expected] :
       {std::pair(scaled, range / std::sqrt(2.0 * 8)), std::pair(unscaled, range)}) {
    INFO("expected stddev " << expected << " over " << moments.n << " values");
    CHECK(std::abs(moments.mean()) < 5 * expected / std::sqrt(double(moments.n)));
    CHECK(moments.stddev() == Approx(expected).epsilon(0.015));
  }
  Gpt2Model again(config), other(config);
  again.init_weights(42);
  other.init_weights(43);
  const size_t bytes = size_t(model.num_parameters()) * sizeof(float);
  CHECK(std::memcmp(model.param_buffer(), again.param_buffer(), bytes) == 0);
  CHECK(std::memcmp(model.param_buffer(), other.param_buffer(), bytes) != 0);
  // Near-uniform predictions at initialization: the loss is about ln(vocab).
  const Batch batch = random_batch(256, kGpt2Batch, kGpt2SeqLen, 12);
  CHECK(model.forward(batch.tokens.data(), batch.targets.data(), kGpt2Batch, kGpt2SeqLen) ==
        Approx(std::log(256.0)).epsilon(0.05));
}

TEST_CASE("gpt2 stage refuses what the model cannot compute", "[gpt2][stage]") {
  Gpt2Model model(narrow_config(false));
  CHECK_THROWS_WITH(model.forward(nullptr, nullptr, 1, 8),
                    Contains("seq_len 8 is beyond n_positions 7"));
  Batch batch = random_batch(11, 1, 7, 13);
  CHECK_NOTHROW(model.forward(batch.tokens.data(), batch.targets.data(), 1, 7));
  batch.tokens[3] = 11;
  CHECK_THROWS_AS(model.forward(batch.tokens.data(), batch.targets.data(), 1, 7),
                  std::out_of_range);
  const auto stage = [](const Gpt2Config& config, StageLayout layout) {
    stage_fixture::OwnedStage<Gpt2> owned(config, layout);
  };
  CHECK_THROWS_WITH(stage(four_block_config(true), {0, 2, true, false}),
                    Contains("tied embeddings cannot be split across pipeline stages"));
  CHECK_THROWS_WITH(stage(four_block_config(false), {1, 3, false, true}), Contains("head"));
  Gpt2Config uneven = narrow_config(false);
  uneven.n_head = 3;
  CHECK_THROWS_WITH(Gpt2Model(uneven),
                    Contains("model.n_embd: 8 must be divisible by model.n_head"));
}

TEST_CASE("gpt2 refuses parameters no machine can hold, before any size overflows", "[gpt2]") {
  using Catch::Matchers::Contains;
  Gpt2Config config = narrow_config(false);
  config.n_inner = int64_t{1} << 62;  // x n_embd overflowed int64_t
  CHECK_THROWS_WITH(meshrun::gpt2::model_parameters(config),
                    Contains("model.n_inner: 4611686018427387904 makes the parameters take ") &&
                        Contains(" bytes as float32, more than the 2^47 bytes"));
}

}  // namespace gpt2_model_test
