// The trainer's single-process pieces: AdamW against PyTorch's formula, the
// learning-rate schedule, hook ranges, sampling, safetensors round trips.
// End-to-end runs are in tests/train/test_train.py.
#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>

#include "train/data.hpp"
#include "train/hooks.hpp"
#include "train/optimizer.hpp"
#include "train/safetensors.hpp"

using namespace meshrun;

TEST_CASE("train: AdamW takes torch.optim.AdamW's first step", "[train]") {
  TrainConfig config;
  config.beta1 = 0.9;
  config.beta2 = 0.999;
  config.eps = 1e-8;
  config.weight_decay = 0.1;
  train::AdamW adamw(config, {1, 0});
  float params[2] = {1.0f, 1.0f};
  const float grads[2] = {0.5f, 0.5f};
  adamw.step(params, grads, 0.1);
  // Bias correction makes the first step lr * sign(g); decay scales by 1 - lr * wd.
  CHECK(params[0] == Approx(0.99 - 0.1).epsilon(1e-6));
  CHECK(params[1] == Approx(1.0 - 0.1).epsilon(1e-6));
  CHECK(adamw.steps_taken() == 1);
}

TEST_CASE("train: learning rate warms up linearly, then decays to min_lr", "[train]") {
  TrainConfig config;
  config.steps = 20;
  config.warmup_steps = 4;
  config.lr = 1.0;
  config.min_lr = 0.1;
  CHECK(train::learning_rate(config, 0) == Approx(0.25));
  CHECK(train::learning_rate(config, 3) == Approx(1.0));
  CHECK(train::learning_rate(config, 4) == Approx(1.0));
  CHECK(train::learning_rate(config, 19) == Approx(0.1));
  CHECK(train::learning_rate(config, 12) < train::learning_rate(config, 8));
}

TEST_CASE("train: clipping scales to max_grad_norm like clip_grad_norm_", "[train]") {
  float grads[2] = {3.0f, 4.0f};
  const double norm = std::sqrt(train::squared_norm(grads, 2));
  CHECK(norm == Approx(5.0));
  train::clip_gradients(grads, 2, norm, 1.0);
  CHECK(std::sqrt(train::squared_norm(grads, 2)) == Approx(1.0).epsilon(1e-5));
}

TEST_CASE("train: hook ranges tile the buffers in parameter order", "[train]") {
  llama::LlamaConfig config;
  config.hidden_size = 16;
  config.intermediate_size = 32;
  config.num_hidden_layers = 3;
  config.num_attention_heads = 2;
  config.num_key_value_heads = 1;
  llama::LlamaModel model(config);
  const auto ranges = train::parameter_ranges(model);
  REQUIRE(ranges.size() == model.parameters().size());
  int64_t next = 0;
  for (size_t p = 0; p < ranges.size(); ++p) {
    CHECK(ranges[p].first == next);
    CHECK(ranges[p].first == model.parameters()[p].data - model.param_buffer());
    next = ranges[p].second;
  }
  CHECK(next == model.num_parameters());
}

TEST_CASE("train: training samples stay in the training part and depend on (seed, step, index)",
          "[train]") {
  Config config;
  config.data.seq_len = 64;
  const train::TokenData data(config);
  for (int64_t i = 0; i < 1000; ++i) {
    const int64_t offset = data.sample_offset(1, i / 10, i % 10);
    CHECK(offset >= 0);
    CHECK(offset + data.seq_len() + 1 <= data.train_bytes());
  }
  CHECK(data.sample_offset(1, 2, 3) == data.sample_offset(1, 2, 3));
  CHECK(data.sample_offset(1, 2, 3) != data.sample_offset(2, 2, 3));
}

TEST_CASE("train: safetensors round trip in F32 and BF16", "[train]") {
  const std::string path =
      (std::filesystem::temp_directory_path() / "meshrun-test.safetensors").string();
  const float values[3] = {1.0f, -2.5f, 1.0f / 3.0f};
  for (const bool bfloat16 : {false, true}) {
    train::write_safetensors(path, {{"a.weight", {3}, values, 3}}, bfloat16);
    const train::SafetensorsFile file(path);
    REQUIRE(file.tensors().count("a.weight") == 1);
    CHECK(file.tensors().at("a.weight").dtype == (bfloat16 ? "BF16" : "F32"));
    float back[2] = {};
    file.read("a.weight", 1, 2, back);
    CHECK(back[0] == -2.5f);
    CHECK(back[1] == Approx(1.0 / 3.0).epsilon(bfloat16 ? 1e-2 : 1e-7));
  }
  std::remove(path.c_str());
}
