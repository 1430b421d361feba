// The Llama pipeline stage: a chain of stages computes exactly what the whole
// model does; microbatches in flight together, and backwards split into
// input and weight parts, give the same gradients as one microbatch at a
// time; the state kept per microbatch is freed by its backward; misuse is
// refused with a message.
//
// Exact equality holds because a chain of stages runs the model's kernels
// (decoder.hpp) on the same shapes in the same order: the stage boundaries
// only copy hidden states and their gradients, and each weight gradient is
// one GEMM accumulated into the buffer in the same microbatch order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "finite_differences.hpp"
#include "llama/model.hpp"
#include "llama/stage.hpp"
#include "llama_fixture.hpp"

namespace llama_stage_test {

using Catch::Matchers::Contains;
using llama_fixture::OwnedStage;
using meshrun::llama::LlamaConfig;
using meshrun::llama::LlamaStage;
using meshrun::llama::ParameterView;
using meshrun::llama::StageLayout;

// Four layers to split three ways; head_dim 4 and grouped kv heads.
LlamaConfig four_layer_config(bool tied = false) {
  LlamaConfig config;
  config.vocab_size = 11;
  config.hidden_size = 16;
  config.intermediate_size = 12;
  config.num_hidden_layers = 4;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.rope_theta = 100.0;
  config.tie_word_embeddings = tied;
  return config;
}

// Weights 15x the initialization's (std 0.3) so attention is peaked and
// every gradient is well away from zero.
std::unique_ptr<LlamaModel> make_model(const LlamaConfig& config, uint64_t seed) {
  auto model = std::make_unique<LlamaModel>(config);
  model->init_weights(seed);
  for (ParameterView& view : model->parameters()) {
    if (view.shape.size() == 1) continue;  // norms stay 1
    std::transform(view.data, view.data + view.numel, view.data, [](float w) { return 15 * w; });
  }
  return model;
}

using stage_fixture::Batch;
using stage_fixture::Gradients;
using stage_fixture::gradients_of;
using Chain = stage_fixture::Chain<meshrun::llama::Llama>;

Batch random_batch(const LlamaConfig& config, uint32_t seed) {
  return stage_fixture::random_batch(config.vocab_size, kBatch, kSeqLen, seed);
}

std::vector<Batch> random_batches(const LlamaConfig& config, int count) {
  std::vector<Batch> batches;
  for (int mb = 0; mb < count; ++mb) batches.push_back(random_batch(config, 100 + mb));
  return batches;
}

// Even split of 4 layers over 3 stages (remainder to the first); a stage of
// the embedding alone and one of the head alone; one stage of everything.
std::vector<std::vector<StageLayout>> splits() {
  return {{{0, 2, true, false}, {2, 3, false, false}, {3, 4, false, true}},
          {{0, 0, true, false}, {0, 4, false, false}, {4, 4, false, true}},
          {{0, 4, true, true}}};
}

TEST_CASE("llama stages hold the model's parameters by Hugging Face name, in its order",
          "[llama][stage]") {
  const auto model = make_model(four_layer_config(), 1);
  Chain chain(*model, splits()[0], kBatch, kSeqLen);
  std::vector<std::string> names;
  std::vector<int64_t> indices;
  for (const LlamaStage* stage : chain.stages) {
    for (const ParameterView& view : stage->parameters()) {
      names.push_back(view.name);
      indices.push_back(view.index);
    }
  }
  std::vector<std::string> model_names;
  std::vector<int64_t> model_indices;
  for (const ParameterView& view : model->parameters()) {
    model_names.push_back(view.name);
    model_indices.push_back(view.index);
  }
  CHECK(names == model_names);
  CHECK(indices == model_indices);
  CHECK(chain.stages[0]->parameters()[0].name == "model.embed_tokens.weight");
  CHECK(chain.stages[1]->parameters()[0].name == "model.layers.2.input_layernorm.weight");
  CHECK(chain.stages[2]->parameters().back().name == "lm_head.weight");
}

// The splits, and one stage of the whole model with tied embeddings.
struct ChainCase {
  bool tied;
  std::vector<StageLayout> layouts;
};

std::vector<ChainCase> chain_cases() {
  std::vector<ChainCase> cases;
  for (const auto& layouts : splits()) cases.push_back({false, layouts});
  cases.push_back({true, {{0, 4, true, true}}});
  return cases;
}

TEST_CASE("llama stages in a chain give exactly the model's loss and gradients", "[llama][stage]") {
  const ChainCase chain_case = GENERATE(from_range(chain_cases()));
  const std::vector<StageLayout>& layouts = chain_case.layouts;
  INFO("stages " << layouts.size() << ", first ends at layer " << layouts[0].end_layer << ", tied "
                 << chain_case.tied);
  const LlamaConfig config = four_layer_config(chain_case.tied);
  const auto model = make_model(config, 2);
  Chain chain(*model, layouts, kBatch, kSeqLen);
  const Batch batch = random_batch(config, 3);

  const float expected = model->forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen);
  model->backward();
  CHECK(chain.run("F0 B0", {batch}, 1.0f).at(0) == expected);
  CHECK(chain.gradients() == gradients_of(model->parameters()));
}

// Each weight gradient receives the microbatches' contributions in the same
// order (0, 1, 2, 3) in every schedule below, so the sums are equal bit for
// bit, whatever else is in flight in between.
TEST_CASE("llama stages with microbatches in flight together accumulate as one at a time",
          "[llama][stage]") {
  const LlamaConfig config = four_layer_config();
  const auto model = make_model(config, 6);
  const std::vector<Batch> batches = random_batches(config, 4);
  Chain one_by_one(*model, splits()[0], kBatch, kSeqLen);
  const auto expected_losses = one_by_one.run("F0 B0 F1 B1 F2 B2 F3 B3", batches, 0.25f);
  const Gradients expected = one_by_one.gradients();

  const std::string schedule = GENERATE(std::string("F0 F1 F2 B0 F3 B1 B2 B3"),
                                        std::string("F0 F1 I0 F2 I1 W0 F3 I2 W1 W2 B3"));
  INFO(schedule);
  Chain interleaved(*model, splits()[0], kBatch, kSeqLen);
  CHECK(interleaved.run(schedule, batches, 0.25f) == expected_losses);
  CHECK(interleaved.gradients() == expected);
  CHECK(interleaved.activation_bytes() == 0);
}

// W runs the GEMMs B would have run, on copies of the same dy and the same x,
// into gradients that receive each microbatch's share once: equal bits.
TEST_CASE("llama stage backward_input then backward_weight equals backward", "[llama][stage]") {
  const LlamaConfig config = four_layer_config();
  const auto model = make_model(config, 7);
  const std::vector<Batch> batches = random_batches(config, 1);
  Chain full(*model, splits()[0], kBatch, kSeqLen), split(*model, splits()[0], kBatch, kSeqLen);
  full.run("F0 B0", batches, 1.0f);
  split.run("F0 I0", batches, 1.0f);
  CHECK(split.grad_inputs == full.grad_inputs);
  for (size_t s = 0; s < split.stages.size(); ++s) {
    for (const ParameterView& view : split.owned(s).parameters()) {
      const bool computed_in_i = view.shape.size() == 1 || view.name == "model.embed_tokens.weight";
      INFO(view.name);
      CHECK(std::any_of(view.grad, view.grad + view.numel, [](float g) { return g != 0; }) ==
            computed_in_i);
    }
  }
  split.backward_weight(0);
  CHECK(split.gradients() == full.gradients());
}

// Two microbatches of one sequence each, loss_scale 1/2, against the model
// on both sequences at once: the same mean loss, so the same gradients up to
// summation order (a weight gradient is one GEMM over 10 rows against two
// over 5, accumulated). Seen: at most 5e-7 of the tensor's largest
// gradient; entries near zero differ by more relative to themselves, so the
// bound, 2e-6, is relative to the tensor's scale.
TEST_CASE("llama stage loss_scale 1/m averages the microbatches' losses", "[llama][stage]") {
  const LlamaConfig config = four_layer_config();
  const auto model = make_model(config, 8);
  const Batch batch = random_batch(config, 9);
  const float expected = model->forward(batch.tokens.data(), batch.targets.data(), kBatch, kSeqLen);
  model->backward();

  Chain chain(*model, splits()[0], kBatch, kSeqLen);
  for (LlamaStage* stage : chain.stages) stage->set_shape(1, kSeqLen);
  std::vector<Batch> halves(2);
  for (int mb = 0; mb < 2; ++mb) {
    const auto first = batch.tokens.begin() + mb * kSeqLen;
    halves[mb].tokens.assign(first, first + kSeqLen);
    const auto first_target = batch.targets.begin() + mb * kSeqLen;
    halves[mb].targets.assign(first_target, first_target + kSeqLen);
  }
  const auto losses = chain.run("F0 F1 B0 B1", halves, 0.5f);
  CHECK((losses.at(0) + losses.at(1)) / 2 == Approx(expected).epsilon(1e-6));
  const Gradients stage_gradients = chain.gradients();
  for (const auto& [name, gradient] : gradients_of(model->parameters())) {
    const std::vector<double> expected_gradient(gradient.begin(), gradient.end());
    float scale = 0;
    for (float g : gradient) scale = std::max(scale, std::abs(g));
    finite_differences::require_close(name, stage_gradients.at(name).data(), expected_gradient,
                                      2e-6 * scale, 0.0);
  }
}

TEST_CASE("llama stage frees each microbatch's state when its backward is done", "[llama][stage]") {
  const LlamaConfig config = four_layer_config();
  const auto model = make_model(config, 10);
  const std::vector<Batch> batches = random_batches(config, 3);
  Chain chain(*model, splits()[0], kBatch, kSeqLen);
  LlamaStage& middle = *chain.stages[1];
  CHECK(middle.activation_bytes() == 0);
  chain.run("F0", batches, 1.0f);
  const int64_t one = middle.activation_bytes();
  CHECK(one > 0);
  chain.run("F1 F2", batches, 1.0f);
  CHECK(middle.activation_bytes() == 3 * one);
  chain.run("B0", batches, 1.0f);
  CHECK(middle.activation_bytes() == 2 * one);
  chain.run("I1", batches, 1.0f);
  const int64_t after_input = middle.activation_bytes() - one;
  CHECK(0 < after_input);
  // The attention probabilities and the norms' inputs are gone; W keeps
  // each linear's dy and x.
  CHECK(after_input < one);
  chain.run("W1", batches, 1.0f);
  CHECK(middle.activation_bytes() == one);
  chain.run("I2 W2", batches, 1.0f);
  CHECK(chain.activation_bytes() == 0);
}

TEST_CASE("llama stage refuses misuse with a message", "[llama][stage]") {
  const LlamaConfig config = four_layer_config();
  const auto model = make_model(config, 11);
  const std::vector<Batch> batches = random_batches(config, 2);
  Chain chain(*model, splits()[0], kBatch, kSeqLen);
  LlamaStage& last = *chain.stages[2];
  std::vector<float> input(last.input_numel()), grad_input(last.input_numel());

  CHECK_THROWS_WITH(last.backward(0, 1.0f, nullptr, grad_input.data()),
                    Contains("microbatch 0: backward without its forward"));
  CHECK_THROWS_WITH(last.backward_weight(0), Contains("backward_weight needs its backward_input"));
  chain.run("F0", batches, 1.0f);
  CHECK_THROWS_WITH(chain.forward(0, batches[0]), Contains("microbatch 0 is already in flight"));
  CHECK_THROWS_WITH(last.backward_weight(0), Contains("backward_weight needs its backward_input"));
  CHECK_THROWS_AS(chain.stages[1]->backward(0, 1.0f, nullptr, grad_input.data()),
                  std::invalid_argument);  // no grad_output
  CHECK_THROWS_WITH(chain.stages[1]->set_shape(1, 3), Contains("in flight"));
  chain.run("I0", batches, 1.0f);
  CHECK_THROWS_WITH(last.backward(0, 1.0f, nullptr, grad_input.data()),
                    Contains("backward after its backward_input"));
  chain.run("W0", batches, 1.0f);

  CHECK_THROWS_AS(last.forward(1, nullptr, nullptr, input.data(), nullptr), std::invalid_argument);
  Batch bad = batches[1];
  bad.targets[2] = int32_t(config.vocab_size);
  CHECK_THROWS_AS(last.forward(1, nullptr, bad.targets.data(), input.data(), nullptr),
                  std::out_of_range);
  bad.tokens[4] = -1;
  std::vector<float> output(chain.stages[0]->output_numel());
  CHECK_THROWS_AS(chain.stages[0]->forward(1, bad.tokens.data(), nullptr, nullptr, output.data()),
                  std::out_of_range);
  CHECK(chain.activation_bytes() == 0);  // nothing kept of a refused forward
  OwnedStage unshaped(config, {0, 2, true, false});
  CHECK_THROWS_WITH(
      unshaped.stage().forward(0, batches[0].tokens.data(), nullptr, nullptr, output.data()),
      Contains("before set_shape"));
}

TEST_CASE("llama stages checkpointing layers give exactly the results of keeping them",
          "[llama][stage]") {
  const LlamaConfig config = four_layer_config();
  const auto model = make_model(config, 12);
  stage_fixture::check_checkpointing_is_exact(*model, splits()[0], random_batches(config, 4),
                                              kBatch, kSeqLen);
}

// Keeping the activations in bfloat16 (a bfloat16 run's) rounds what the
// backward reads, and the mid-layer residual and MLP projection the
// forward's element-wise ops read, by at most 2^-9 relative: the loss
// within 1e-3 relative, every parameter's gradient within 2% (L2,
// relative) of keeping float32, and what a microbatch holds at most 0.6 of
// float32's (this model's residual stream, norm statistics, log-sum-exps
// and logits, which stay float32, are a larger share than a real model's:
// hidden 16, vocabulary 11).
TEST_CASE("llama stage keeping bfloat16 activations holds half and computes as float32",
          "[llama][stage]") {
  const LlamaConfig config = four_layer_config();
  const auto model = make_model(config, 13);
  const std::vector<Batch> batches = random_batches(config, 1);
  Chain float32(*model, splits()[0], kBatch, kSeqLen);
  Chain bfloat16(*model, splits()[0], kBatch, kSeqLen, {}, true);
  const float loss = float32.run("F0", batches, 1.0f).at(0);
  CHECK(bfloat16.run("F0", batches, 1.0f).at(0) == Approx(loss).epsilon(1e-3));
  const int64_t kept = bfloat16.activation_bytes(), full = float32.activation_bytes();
  INFO("bytes held: bfloat16 " << kept << ", float32 " << full);
  CHECK(double(kept) <= 0.6 * double(full));
  bfloat16.run("B0", batches, 1.0f);
  float32.run("B0", batches, 1.0f);
  const stage_fixture::Gradients expected = float32.gradients();
  for (const auto& [name, gradient] : bfloat16.gradients()) {
    const std::vector<float>& reference = expected.at(name);
    double difference = 0, norm = 0;
    for (size_t i = 0; i < gradient.size(); ++i) {
      difference += std::pow(double(gradient[i]) - reference[i], 2);
      norm += std::pow(double(reference[i]), 2);
    }
    INFO(name << ": relative difference " << std::sqrt(difference / norm));
    CHECK(std::sqrt(difference / norm) <= 0.02);
  }
}

TEST_CASE("llama stage rejects layouts that do not fit the model", "[llama][stage]") {
  const LlamaConfig config = four_layer_config();
  const auto stage = [](const LlamaConfig& c, StageLayout layout) { OwnedStage owned(c, layout); };
  CHECK_THROWS_WITH(stage(four_layer_config(true), {0, 2, true, false}),
                    Contains("tied embeddings cannot be split across pipeline stages"));
  CHECK_THROWS_AS(stage(four_layer_config(true), {2, 4, false, true}), std::invalid_argument);
  CHECK_THROWS_WITH(stage(config, {1, 2, true, false}), Contains("embedding goes on"));
  CHECK_THROWS_WITH(stage(config, {1, 3, false, true}), Contains("head"));
  CHECK_THROWS_WITH(stage(config, {2, 2, false, false}), Contains("holds at least"));
  CHECK_THROWS_AS(stage(config, {3, 5, false, false}), std::invalid_argument);
  CHECK_THROWS_AS(stage(config, {3, 2, false, false}), std::invalid_argument);
  CHECK_THROWS_WITH(
      OwnedStage(config, {0, 4, true, true}, {{4, meshrun::models::Recomputation::full}}),
      Contains("checkpointed layer 4 is not within the model's [0, 4)"));
}

}  // namespace llama_stage_test
