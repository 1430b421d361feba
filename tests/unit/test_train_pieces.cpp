// The trainer's single-process pieces: AdamW against PyTorch's formula, the
// learning-rate schedule, the layout of a model's parameters and units,
// bfloat16 storage, sampling, safetensors round trips.
// End-to-end runs are in tests/train/test_train.py.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "model/model.hpp"
#include "model/tensor_parallel.hpp"
#include "plan/tp_plan.hpp"
#include "state/local_parameters.hpp"
#include "state/optimizer.hpp"
#include "state/safetensors.hpp"
#include "temp_folder.hpp"
#include "train/data.hpp"
#include "train/hooks.hpp"

using namespace meshrun;

TEST_CASE("train: AdamW takes torch.optim.AdamW's first step", "[train]") {
  TrainConfig config;
  config.beta1 = 0.9;
  config.beta2 = 0.999;
  config.eps = 1e-8;
  config.weight_decay = 0.1;
  meshrun::AdamW adamw(config, {1, 0});
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
  CHECK(meshrun::learning_rate(config, 0) == Approx(0.25));
  CHECK(meshrun::learning_rate(config, 3) == Approx(1.0));
  CHECK(meshrun::learning_rate(config, 4) == Approx(1.0));
  CHECK(meshrun::learning_rate(config, 19) == Approx(0.1));
  CHECK(meshrun::learning_rate(config, 12) < meshrun::learning_rate(config, 8));
}

TEST_CASE("train: clipping scales to max_grad_norm like clip_grad_norm_", "[train]") {
  float grads[2] = {3.0f, 4.0f};
  const double norm = std::sqrt(meshrun::squared_norm(grads, 2));
  CHECK(norm == Approx(5.0));
  meshrun::clip_gradients(meshrun::host_state_device(), grads, 2, norm, 1.0);
  CHECK(std::sqrt(meshrun::squared_norm(grads, 2)) == Approx(1.0).epsilon(1e-5));
}

TEST_CASE("train: the first parameter with a non-finite gradient, in the description's order",
          "[train]") {
  // A shard holding parts of description parameters 5 and 2, in that order.
  std::vector<float> grads = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f};
  meshrun::LocalParameters local;
  local.grads = grads.data();
  local.numel = int64_t(grads.size());
  local.held = {{10, 0, 2}, {4, 2, 3}};
  local.held_parameter = {0, 1};
  const std::vector<int64_t> description_index = {5, 2};
  CHECK_FALSE(
      meshrun::first_nonfinite_gradient(meshrun::host_state_device(), local, description_index));
  grads[1] = std::numeric_limits<float>::infinity();
  CHECK(meshrun::first_nonfinite_gradient(meshrun::host_state_device(), local, description_index) ==
        5);
  grads[4] = std::nanf("");
  CHECK(meshrun::first_nonfinite_gradient(meshrun::host_state_device(), local, description_index) ==
        2);
}

// A description with a root unit around two layer units, the root's
// parameters on both sides of the layers'.
const char* const kDescription = R"({
  "config": {"model_type": "toy"},
  "parameters": [
    {"name": "embed", "shape": [4, 2], "unit": "root"},
    {"name": "layers.0.w", "shape": [2, 2], "unit": "layers.0"},
    {"name": "layers.0.b", "shape": [2], "unit": "layers.0"},
    {"name": "layers.1.w", "shape": [3, 2], "unit": "layers.1"},
    {"name": "head", "shape": [4, 2], "unit": "root"}],
  "units": ["layers.0", "layers.1", "root"],
  "modules": [{"name": "embed", "parameters": ["embed"]},
              {"name": "layers.0", "parameters": ["layers.0.w", "layers.0.b"]},
              {"name": "layers.1", "parameters": ["layers.1.w"]},
              {"name": "head", "parameters": ["head"]}],
  "vocab_size": 4})";

// `text` with its first `from` replaced by `to`.
std::string replaced(std::string text, const std::string& from, const std::string& to) {
  text.replace(text.find(from), from.size(), to);
  return text;
}

// A description's `text` with `fields` (", \"key\": value, ...") added last.
std::string with_fields(std::string text, const std::string& fields) {
  text.replace(text.rfind('}'), 1, fields + "}");
  return text;
}

TEST_CASE("train: flat buffers and strategy units follow the model's description", "[train]") {
  const ModelDescription d = parse_description(kDescription, "toy");
  CHECK(d.numel == 8 + 4 + 2 + 6 + 8);
  CHECK(d.parameters[4].offset == 20);
  meshrun::FlatParameters all(d, {0, 1, 2, 3, 4}, meshrun::host_state_device());
  CHECK(all.offsets == std::vector<int64_t>{0, 8, 12, 14, 20, 28});
  const train::StageUnits units = train::stage_units(d, {{0, 1, 2, 3, 4}, {0, 1, 2}});
  CHECK(units.strategy.num_units == 3);
  CHECK(units.strategy.root_unit == 2);
  CHECK(units.strategy.parameter_units == std::vector<int32_t>{2, 0, 0, 1, 2});
  CHECK(units.strategy.parameter_rows == std::vector<int64_t>{4, 2, 2, 3, 4});
  // Offsets within each unit's flat view: the root holds embed, then head.
  CHECK(units.offset_in_unit == std::vector<int64_t>{0, 0, 4, 0, 8});

  // A middle pipeline stage: one layer, no root; its layer is unit 0.
  meshrun::FlatParameters middle(d, {3}, meshrun::host_state_device());
  CHECK(middle.position[3] == 0);
  CHECK(middle.position[0] == -1);
  const train::StageUnits stage = train::stage_units(d, {{3}, {1}});
  CHECK(stage.strategy.num_units == 1);
  CHECK(stage.strategy.root_unit == 0);
  CHECK(stage.of_model_unit == std::vector<int32_t>{-1, 0, -1});
}

TEST_CASE("train: descriptions that do not hold together are refused naming the field", "[train]") {
  using Catch::Matchers::Contains;
  const auto broken = [](const std::string& from, const std::string& to) {
    return replaced(kDescription, from, to);
  };
  CHECK_THROWS_WITH(
      parse_description(broken(R"("layers.1", "root"])", R"("root", "layers.1"])"), "toy"),
      Contains("the last unit must be \"root\""));
  CHECK_THROWS_WITH(
      parse_description(broken(R"("unit": "layers.1")", R"("unit": "layers.9")"), "toy"),
      Contains("unit 'layers.9'"));
  CHECK_THROWS_WITH(parse_description(broken(R"({"name": "head", "parameters": ["head"]})",
                                             R"({"name": "head", "parameters": []})"),
                                      "toy"),
                    Contains("parameter 'head' is used by no module"));
  CHECK_THROWS_WITH(parse_description(broken(R"([2, 2])", R"([2, 0])"), "toy"),
                    Contains("parameters[1].shape"));
  CHECK_THROWS_WITH(parse_description("[]", "toy"), Contains("not a JSON object"));
  // 2^62 x 256 elements overflowed int64_t; 2^45 x 2 is past any address space.
  CHECK_THROWS_WITH(parse_description(broken(R"([4, 2])", R"([4611686018427387904, 256])"), "toy"),
                    Contains("parameters[0] ('embed') take 4.722e+21 bytes as float32") &&
                        Contains("2^47 bytes"));
  CHECK_THROWS_WITH(parse_description(broken(R"([4, 2])", R"([35184372088832, 2])"), "toy"),
                    Contains("parameters[0] ('embed') take 2.815e+14 bytes"));
  CHECK_THROWS_WITH(parse_description(broken(R"([2, 2])", R"([17592186044416, 2])"), "toy"),
                    Contains("the parameters take 1.407e+14 bytes"));
}

// The toy with its embedding and head as units of their own (ABI 1.11),
// listed after the layers, and the root holding nothing.
std::string split_root_toy() {
  std::string text = replaced(kDescription, R"("embed", "shape": [4, 2], "unit": "root")",
                              R"("embed", "shape": [4, 2], "unit": "in")");
  text = replaced(text, R"("head", "shape": [4, 2], "unit": "root")",
                  R"("head", "shape": [4, 2], "unit": "out")");
  return replaced(text, R"("units": ["layers.0", "layers.1", "root"])",
                  R"("units": ["layers.0", "layers.1", "in", "out", "root"], )"
                  R"("unit_kinds": ["layer", "layer", "embedding", "head", "root"])");
}

TEST_CASE("train: the embedding and the head units run around the layers, the root encloses them",
          "[train]") {
  using Catch::Matchers::Contains;
  const ModelDescription d = parse_description(split_root_toy(), "toy");
  CHECK(d.forward_units() == std::vector<int32_t>{2, 0, 1, 3});
  CHECK(d.is_layer_unit(1));
  CHECK_FALSE(d.is_layer_unit(2));
  // The whole model: in forward order, then the root, held though empty.
  const train::StageUnits all = train::stage_units(d, {{0, 1, 2, 3, 4}, {0, 1, 2, 3}});
  CHECK(all.strategy.num_units == 5);
  CHECK(all.strategy.root_unit == 4);
  CHECK(all.of_model_unit == std::vector<int32_t>{1, 2, 0, 3, 4});
  CHECK(all.strategy.parameter_units == std::vector<int32_t>{0, 1, 1, 2, 3});
  // A last pipeline stage: a layer and the head, enclosed by the root.
  const train::StageUnits last = train::stage_units(d, {{3, 4}, {1, 3}});
  CHECK(last.strategy.num_units == 3);
  CHECK(last.strategy.root_unit == 2);
  CHECK(last.strategy.parameter_units == std::vector<int32_t>{0, 1});
  // A middle stage of layers only has no root: its first unit stands for it.
  const train::StageUnits middle = train::stage_units(d, {{1, 2}, {0}});
  CHECK(middle.strategy.num_units == 1);
  CHECK(middle.strategy.root_unit == 0);

  const auto broken = [](const std::string& from, const std::string& to) {
    return replaced(split_root_toy(), from, to);
  };
  CHECK_THROWS_WITH(parse_description(broken(R"("head", "root"])", R"("head", "layer"])"), "toy"),
                    Contains("unit_kinds[4] (\"layer\") must be \"root\""));
  CHECK_THROWS_WITH(
      parse_description(broken(R"("head", "root"])", R"("embedding", "root"])"), "toy"),
      Contains("one \"embedding\" and one \"head\""));
  CHECK_THROWS_WITH(parse_description(broken(R"("layer", "layer",)", R"("layer",)"), "toy"),
                    Contains("an array of 5 kinds"));
}

// The description's activations, and the part a bfloat16 run keeps in
// float32 (ABI 1.10): read when given, absent when not (all float32), and
// refused when a part exceeds its whole.
TEST_CASE("train: a description's activations say which stay float32", "[train]") {
  using Catch::Matchers::Contains;
  const auto with = [](const std::string& float32) {
    return with_fields(kDescription, R"(, "activations": {"layer": {"whole": 10, "tp_split": 6}, )"
                                     R"("elementwise": {"whole": 4, "tp_split": 2}, "stream": 8, )"
                                     R"("head": {"whole": 9, "tp_split": 5})" +
                                         float32 + "}");
  };
  const auto part = [](int layer, int elementwise, int head) {
    const auto pair = [](int whole) {
      return R"({"whole": )" + std::to_string(whole) + R"(, "tp_split": 2})";
    };
    return R"(, "float32": {"layer": )" + pair(layer) + R"(, "elementwise": )" + pair(elementwise) +
           R"(, "head": )" + pair(head) + "}";
  };
  CHECK_FALSE(parse_description(with(""), "toy").activations->float32);
  const ModelDescription split = parse_description(with(part(2, 2, 1)), "toy");
  REQUIRE(split.activations->float32);
  CHECK(split.activations->float32->layer.whole == 2);
  CHECK(split.activations->float32->head.tp_split == 2);
  CHECK_THROWS_WITH(parse_description(with(part(11, 2, 1)), "toy"),
                    Contains("each float32 part at most its whole"));
}

// The GEMMs a forward runs (ABI 1.11 flops.gemms): read with their rows
// and tp splits, and refused unless they hold the matmul weights a token
// meets, or with an entry out of range.
TEST_CASE("train: a description's GEMMs are its matmul parameters, shape by shape", "[train]") {
  using Catch::Matchers::Contains;
  const auto with = [](const std::string& gemms) {
    return with_fields(
        kDescription,
        R"(, "flops": {"matmul_parameters": 14, "attention": {"layers": 0, "width": 0}, "gemms": )" +
            gemms + "}");
  };
  const ModelDescription d = parse_description(
      with(
          R"([{"k": 2, "n": 2, "count": 2, "tp": "n"}, {"k": 2, "n": 3, "count": 2, "rows": 0.5}])"),
      "toy");
  REQUIRE(d.flops->gemms.size() == 2);
  CHECK(d.flops->gemms[0].tp == "n");
  CHECK(d.flops->gemms[1].rows == 0.5);
  CHECK(d.flops->gemms[1].tp.empty());
  CHECK_THROWS_WITH(parse_description(with(R"([{"k": 2, "n": 2, "count": 2}])"), "toy"),
                    Contains("flops.gemms hold 8 weights") && Contains("says 14"));
  CHECK_THROWS_WITH(parse_description(with(R"([{"k": 2, "n": 7, "count": 1, "rows": 2}])"), "toy"),
                    Contains("flops.gemms[0] must be"));
  CHECK_THROWS_WITH(parse_description(with(R"([{"k": 14, "n": 1, "count": 1, "tp": "m"}])"), "toy"),
                    Contains("flops.gemms[0] must be"));
}

// The toy with its layers' weights split over tp in one block, and the
// embedding in another.
std::string tensor_parallel_toy(const std::string& blocks) {
  std::string text = kDescription;
  const auto shard = [&](const std::string& name) {
    const std::string from = "{\"name\": \"" + name + "\", ";
    text = replaced(text, from, from + "\"tp\": \"shard(0)\", ");
  };
  shard("embed");
  shard("layers.0.w");
  shard("layers.1.w");
  return with_fields(text, ", \"tp_blocks\": " + blocks);
}

TEST_CASE("train: tp_blocks group the sharded parameters, and tp_plan chooses among them",
          "[train]") {
  using Catch::Matchers::Contains;
  CHECK(module_matches("layers.*.w", "layers.12.w"));
  CHECK(module_matches("layers.*", "layers.0"));
  CHECK_FALSE(module_matches("layers.*.w", "layers..w"));
  CHECK_FALSE(module_matches("layers.*.w", "layers.0.1.w"));
  CHECK_FALSE(module_matches("layers.*", "layers.0.w"));
  CHECK(module_of("layers.0.w") == "layers.0");

  const std::string blocks =
      R"([{"name": "embedding", "modules": {"embed": "rowwise"}},
          {"name": "layers", "modules": {"layers.*": "colwise"}}])";
  const ModelDescription d = parse_description(tensor_parallel_toy(blocks), "toy");
  REQUIRE(d.tp_blocks.size() == 2);
  CHECK(d.tp_blocks[1].modules[0] == std::pair<std::string, std::string>{"layers.*", "colwise"});

  Config config;
  config.distributed.tp_plan = "layers";
  const TensorParallelChoice layers = choose_tensor_parallel(config, d);
  CHECK(layers.placements ==
        std::vector<std::string>{"replicate", "shard(0)", "replicate", "shard(0)", "replicate"});
  CHECK(layers.rules[0]["style"] == "replicate");
  CHECK(layers.rules[1]["style"] == "colwise");
  config.distributed.tp_plan = "";
  CHECK(choose_tensor_parallel(config, d).placements[0] == "shard(0)");
  config.distributed.tp_plan = "megatron";
  CHECK_THROWS_WITH(choose_tensor_parallel(config, d), Contains("valid are \"default\""));

  CHECK_THROWS_WITH(
      parse_description(tensor_parallel_toy(R"([{"name": "e", "modules": {"embed": "rowwise"}}])"),
                        "toy"),
      Contains("parameter 'layers.0.w' ('shard(0)') is in 0 blocks"));
  CHECK_THROWS_WITH(
      parse_description(
          tensor_parallel_toy(
              R"([{"name": "b", "modules": {"embed": "rowwise", "layers.*": "colwise", "norm": "colwise"}}])"),
          "toy"),
      Contains("block 'b' names module 'norm', which no parameter belongs to"));
  CHECK_THROWS_WITH(
      parse_description(
          tensor_parallel_toy(
              R"j([{"name": "b", "modules": {"embed": "shard(0)", "layers.*": "colwise"}}])j"),
          "toy"),
      Contains("tp_blocks[0].modules[\"embed\"] must be \"colwise\" or \"rowwise\""));
}

TEST_CASE("train: bfloat16 storage rounds to nearest even", "[train]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> values = {
      1.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-7f + 0x1p-12f, -2.5f, nan};
  meshrun::round_to(values.data(), int64_t(values.size()), "bfloat16");
  CHECK(values[0] == 1.0f);
  CHECK(values[1] == 1.0f);            // halfway, to the even 1.0
  CHECK(values[2] == 1.0f + 0x1p-6f);  // halfway, to the even 1 + 2^-6
  CHECK(values[3] == 1.0f + 0x1p-7f);  // below halfway
  CHECK(values[4] == -2.5f);           // representable
  CHECK(std::isnan(values[5]));
  std::vector<float> kept = {1.0f + 0x1p-12f};
  meshrun::round_to(kept.data(), 1, "float32");
  CHECK(kept[0] == 1.0f + 0x1p-12f);
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
  const TempFolder folder("meshrun-test-safetensors");
  const std::string path = folder.file("round-trip.safetensors");
  const float values[3] = {1.0f, -2.5f, 1.0f / 3.0f};
  for (const bool bfloat16 : {false, true}) {
    meshrun::write_safetensors(path, {{"a.weight", {3}, values, 3}}, bfloat16);
    const meshrun::SafetensorsFile file(path);
    REQUIRE(file.tensors().count("a.weight") == 1);
    CHECK(file.tensors().at("a.weight").dtype == (bfloat16 ? "BF16" : "F32"));
    float back[2] = {};
    file.read("a.weight", 1, 2, back);
    CHECK(back[0] == -2.5f);
    CHECK(back[1] == Approx(1.0 / 3.0).epsilon(bfloat16 ? 1e-2 : 1e-7));
  }
}
