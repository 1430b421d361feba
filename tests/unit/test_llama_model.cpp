// The Llama model as a whole (the stage that holds everything, over buffers
// of its own): Hugging Face names in one contiguous buffer; the loss against
// a naive double-precision re-implementation; every parameter's gradient
// against finite differences (of that reference, and of the model's own
// float32 forward); hooks in the documented order; storage bound by the
// hooks; deterministic initialization.
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
#include "llama/model.hpp"
#include "llama_fixture.hpp"
#include "llama_reference.hpp"
#include "model_checks.hpp"

namespace llama_model_test {

using meshrun::llama::LlamaConfig;
using meshrun::llama::ParameterView;

// head_dim 2: the smallest model with every parameter kind and grouped heads.
LlamaConfig narrow_config(bool tied) {
  LlamaConfig config;
  config.vocab_size = 11;
  config.hidden_size = 8;
  config.intermediate_size = 12;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.rope_theta = 10000.0;
  config.tie_word_embeddings = tied;
  return config;
}

// head_dim 4 and a small theta: rotate_half and interleaved pairs differ
// (with head_dim 2 they coincide), and every frequency turns visibly.
LlamaConfig wide_config() {
  LlamaConfig config = narrow_config(false);
  config.hidden_size = 16;
  config.rope_theta = 100.0;
  return config;
}

using stage_fixture::Batch;
using stage_fixture::random_batch;

// Weights far from the 0.02 initialization, so attention is peaked rather
// than uniform and every convention (mask, rotary, head mapping) shows in
// the loss; norm weights away from 1 so their gradients are not degenerate.
// Embedding rows of norm ~sqrt(hidden), so that a finite-difference step is
// small against the row that RMSNorm rescales.
void randomize(LlamaModel& model, uint32_t seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (ParameterView& view : model.parameters()) {
    const bool is_norm = view.shape.size() == 1;
    const float scale = view.name == "model.embed_tokens.weight" ? 1.0f : 0.3f;
    for (int64_t i = 0; i < view.numel; ++i) {
      view.data[i] = is_norm ? 1.0f + 0.2f * normal(engine) : scale * normal(engine);
    }
  }
}

// The reference loss of a batch [kBatch, kSeqLen] from weights by name.
auto reference_of(const LlamaConfig& config) {
  return [config](const reference::Weights& weights, const Batch& batch) {
    return llama_reference::loss(config, weights, batch.tokens.data(), batch.targets.data(), kBatch,
                                 kSeqLen);
  };
}

float forward_backward(LlamaModel& model, const Batch& batch) {
  const float loss = model.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen);
  model.backward();
  return loss;
}

TEST_CASE("llama parameters: Hugging Face names, shapes and order, units by layer", "[llama]") {
  const bool tied = GENERATE(false, true);
  const auto parameters = meshrun::llama::model_parameters(narrow_config(tied));
  const int64_t V = 11, H = 8, I = 12, q = 8, kv = 4;
  model_checks::NamedShapes expected = {{"model.embed_tokens.weight", {V, H}}};
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    expected.insert(expected.end(), {{p + "input_layernorm.weight", {H}},
                                     {p + "self_attn.q_proj.weight", {q, H}},
                                     {p + "self_attn.k_proj.weight", {kv, H}},
                                     {p + "self_attn.v_proj.weight", {kv, H}},
                                     {p + "self_attn.o_proj.weight", {H, q}},
                                     {p + "post_attention_layernorm.weight", {H}},
                                     {p + "mlp.gate_proj.weight", {I, H}},
                                     {p + "mlp.up_proj.weight", {I, H}},
                                     {p + "mlp.down_proj.weight", {H, I}}});
  }
  expected.push_back({"model.norm.weight", {H}});
  if (!tied) expected.push_back({"lm_head.weight", {V, H}});

  // Two layers: the embedding is unit 2 (the root, 4, when tied), the head 3.
  model_checks::check_parameter_list(parameters, expected, "model.layers.",
                                     {{"model.embed_tokens.weight", tied ? 4 : 2},
                                      {"model.norm.weight", 3},
                                      {"lm_head.weight", 3}});
}

TEST_CASE("llama forward matches a naive double-precision Hugging Face reference", "[llama]") {
  const LlamaConfig config = GENERATE(narrow_config(false), narrow_config(true), wide_config());
  INFO("hidden " << config.hidden_size << " tied " << config.tie_word_embeddings);
  LlamaModel model(config);
  randomize(model, 1);
  const Batch batch = random_batch(config.vocab_size, kBatch, kSeqLen, 2);
  const double expected = reference_of(config)(reference::weights_of(model.parameters()), batch);
  // float32 against double: ~1e-7 apart; a wrong convention moves the loss
  // by far more than 1e-5.
  CHECK(model.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen) ==
        Approx(expected).epsilon(1e-5));
}

// Numeric gradients of the double reference (eps 1e-6: accurate to ~1e-9)
// against the model's float32 backward. float32 rounding leaves errors of a
// few 1e-7 on these weights (gradients up to ~1.5), so 1e-5 absolute + 1e-4
// relative keeps a margin of over 10x and still catches any wrong term.
TEST_CASE("llama gradients of every parameter match finite differences of the reference",
          "[llama]") {
  const LlamaConfig config = GENERATE(narrow_config(false), narrow_config(true), wide_config());
  INFO("hidden " << config.hidden_size << " tied " << config.tie_word_embeddings);
  LlamaModel model(config);
  randomize(model, 3);
  model_checks::check_gradients(model, random_batch(config.vocab_size, kBatch, kSeqLen, 4), kBatch,
                                kSeqLen, reference_of(config), 1e-5, 1e-4);
}

// The model against its own float32 forward, independent of the reference.
// With eps = 1e-2 the truncation error (eps^2 / 6 * third derivative)
// dominates and rounding (a few float32 ulps of the loss / 2 eps) adds ~3e-5;
// seen: up to 2e-4. So 5e-4 absolute + 2e-2 relative: coarse, as float32
// differences must be, yet a missing term is off by far more.
TEST_CASE("llama gradients of every parameter match finite differences in float32", "[llama]") {
  const LlamaConfig config = GENERATE(narrow_config(false), narrow_config(true));
  INFO("tied " << config.tie_word_embeddings);
  LlamaModel model(config);
  randomize(model, 5);
  const Batch batch = random_batch(config.vocab_size, kBatch, kSeqLen, 6);
  forward_backward(model, batch);

  for (const ParameterView& view : model.parameters()) {
    const auto numeric = finite_differences::central(view.data, view.numel, 1e-2, [&] {
      return double(model.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen));
    });
    finite_differences::require_close(view.name, view.grad, numeric, 5e-4, 2e-2);
  }
}

TEST_CASE("llama backward accumulates into the gradients", "[llama]") {
  LlamaModel model(narrow_config(false));
  randomize(model, 7);
  const Batch batch = random_batch(11, kBatch, kSeqLen, 8);
  forward_backward(model, batch);
  const std::vector<float> once(model.grad_buffer(), model.grad_buffer() + model.num_parameters());
  forward_backward(model, batch);
  for (int64_t i = 0; i < model.num_parameters(); ++i) {
    REQUIRE(model.grad_buffer()[i] == Approx(2 * once[i]).epsilon(1e-5).margin(1e-9));
  }
  model.zero_grad();
  const float* grads = model.grad_buffer();
  CHECK(std::all_of(grads, grads + model.num_parameters(), [](float g) { return g == 0; }));
}

TEST_CASE("llama calls the hooks in the documented order, gradients final when announced",
          "[llama]") {
  const bool tied = GENERATE(false, true);
  LlamaModel model(narrow_config(tied));
  stage_fixture::RecordingHooks<meshrun::llama::Llama> hooks(model);
  model.set_observer(&hooks);
  forward_backward(model, random_batch(11, kBatch, kSeqLen, 9));
  stage_fixture::check_documented_order(hooks, model);

  const size_t events = hooks.events.size();
  model.set_observer(nullptr);
  forward_backward(model, random_batch(11, kBatch, kSeqLen, 9));
  CHECK(hooks.events.size() == events);
}

TEST_CASE("llama computes the same with units bound to storage that comes and goes", "[llama]") {
  const bool tied = GENERATE(false, true);
  LlamaModel owning(narrow_config(tied));
  randomize(owning, 5);
  stage_fixture::check_unit_storage(owning, random_batch(11, kBatch, kSeqLen, 3), kBatch, kSeqLen);
}

TEST_CASE("llama initialization and loss are deterministic per seed", "[llama]") {
  const LlamaConfig config = narrow_config(false);
  LlamaModel first(config), second(config);
  first.init_weights(42);
  second.init_weights(42);
  const size_t bytes = size_t(first.num_parameters()) * sizeof(float);
  REQUIRE(std::memcmp(first.param_buffer(), second.param_buffer(), bytes) == 0);
  const Batch batch = random_batch(11, kBatch, kSeqLen, 10);
  const float loss = first.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen);
  CHECK(second.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen) == loss);
  // Near-uniform predictions at initialization: the loss is about ln(vocab).
  CHECK(loss == Approx(std::log(11.0)).epsilon(0.05));

  second.init_weights(43);
  CHECK(std::memcmp(first.param_buffer(), second.param_buffer(), bytes) != 0);
}

TEST_CASE("llama initialization: normal(0, 0.02) matrices, unit norms, a pinned stream",
          "[llama]") {
  LlamaConfig config = narrow_config(false);  // an embedding large enough for statistics
  config.vocab_size = 512;
  config.hidden_size = 64;
  LlamaModel model(config);
  model.init_weights(0);
  const ParameterView& embed = model.parameters().front();
  double sum = 0, sum_squares = 0;
  for (int64_t i = 0; i < embed.numel; ++i) {
    sum += embed.data[i];
    sum_squares += double(embed.data[i]) * embed.data[i];
  }
  const double mean = sum / double(embed.numel);
  CHECK(std::abs(mean) < 1e-3);
  CHECK(std::sqrt(sum_squares / double(embed.numel) - mean * mean) == Approx(0.02).epsilon(0.02));
  for (const ParameterView& view : model.parameters()) {
    const bool is_norm = view.shape.size() == 1;
    if (is_norm)
      CHECK(std::all_of(view.data, view.data + view.numel, [](float w) { return w == 1; }));
  }
  // splitmix64 + Box-Muller are fully specified: these values (computed
  // apart, in Python) hold on every platform and standard library, and a
  // change to them breaks the reproducibility of runs.
  CHECK(embed.data[0] == Approx(-0.0090551544).margin(1e-9));
  CHECK(embed.data[1] == Approx(0.0530121177).margin(1e-9));
}

TEST_CASE("llama forward reuses or reallocates buffers as the shape changes", "[llama]") {
  LlamaModel model(narrow_config(false));
  randomize(model, 11);
  const Batch batch = random_batch(11, kBatch, kSeqLen, 12);
  const float full = model.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen);
  // The first sequence's first three tokens alone: a different shape.
  const float prefix = model.forward(batch.tokens.data(), batch.targets.data(), 1, 3);
  const auto weights = llama_reference::weights_of(model.parameters());
  CHECK(prefix == Approx(llama_reference::loss(model.config(), weights, batch.tokens.data(),
                                               batch.targets.data(), 1, 3))
                      .epsilon(1e-4));
  CHECK(model.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen) == full);
}

TEST_CASE("llama rejects bad input", "[llama]") {
  LlamaConfig config = narrow_config(false);
  config.num_key_value_heads = 3;
  CHECK_THROWS_AS(LlamaModel(config), std::invalid_argument);
  config = narrow_config(false);
  config.num_attention_heads = 8;  // head_dim 1: rotary needs pairs
  CHECK_THROWS_AS(LlamaModel(config), std::invalid_argument);

  LlamaModel model(narrow_config(false));
  CHECK_THROWS_AS(model.backward(), std::logic_error);
  Batch batch = random_batch(11, kBatch, kSeqLen, 13);
  batch.targets[3] = 11;
  CHECK_THROWS_AS(model.forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen),
                  std::out_of_range);
  batch.targets[3] = 0;
  forward_backward(model, batch);
  CHECK_THROWS_AS(model.backward(), std::logic_error);
}

TEST_CASE("llama refuses parameters no machine can hold, before any size overflows", "[llama]") {
  using Catch::Matchers::Contains;
  LlamaConfig config = narrow_config(false);
  config.vocab_size = int64_t{1} << 62;  // x hidden_size overflowed int64_t
  CHECK_THROWS_WITH(meshrun::llama::model_parameters(config),
                    Contains("model.vocab_size: 4611686018427387904 makes the parameters take ") &&
                        Contains("e+2") && Contains(" bytes as float32, more than the 2^47 bytes"));
  config = narrow_config(false);
  config.hidden_size = 1 << 20;
  config.intermediate_size = int64_t{1} << 30;
  CHECK_THROWS_WITH(meshrun::llama::model_parameters(config),
                    Contains("model.intermediate_size: 1073741824 makes the parameters take"));
}

}  // namespace llama_model_test
