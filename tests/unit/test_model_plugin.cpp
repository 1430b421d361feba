// The shipped model plugins (Llama, GPT-2) through the model ABI, as the
// trainer drives them: their [model] keys checked when the plan is made
// (errors at the key's place in the file), their descriptions, and a stage
// over host storage computing exactly what the model library computes.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "errors.hpp"
#include "gpt2/stage.hpp"
#include "llama_fixture.hpp"
#include "model/model.hpp"
#include "plan/plan.hpp"
#include "raw_stage_setup.hpp"

namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;
using meshrun::Config;
using meshrun::Model;
using meshrun::ModelStage;
using meshrun::ParameterStorage;

const meshrun::PluginLoader& loader() {
  static const meshrun::PluginLoader instance = meshrun::PluginLoader::from_environment();
  return instance;
}

meshrun::Plan plan_of(const std::string& toml, const std::vector<std::string>& overrides = {},
                      int64_t world = 1) {
  static std::vector<std::unique_ptr<Config>> configs;  // a Plan points at its config
  configs.push_back(std::make_unique<Config>(meshrun::parse_config(toml, "cfg.toml", overrides)));
  return meshrun::make_plan(*configs.back(), world, loader());
}

std::string plan_error(const std::string& toml, const std::vector<std::string>& overrides = {},
                       int64_t world = 1) {
  try {
    plan_of(toml, overrides, world);
  } catch (const meshrun::Error& error) {
    CHECK(error.is_input_error());
    return error.what();
  }
  FAIL("the plan was made");
  return "";
}

const char* const kTiny = R"([model]
model_type = "llama"
vocab_size = 11
hidden_size = 16
intermediate_size = 12
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
)";

TEST_CASE("model plugin: llama's keys are checked at plan time, at their place in the file",
          "[model]") {
  CHECK_THAT(plan_error(kTiny, {"model.hidden_size=102"}),
             StartsWith("override 'model.hidden_size=102': model.hidden_size: 102 must be "
                        "divisible by model.num_attention_heads (4)"));
  CHECK_THAT(plan_error(std::string(kTiny) + "banana = 1\n"),
             StartsWith("cfg.toml:9:1: model.banana: unknown key for model_type 'llama'; valid "
                        "keys in [model]: model_type, torch_dtype, checkpoint, vocab_size, "));
  CHECK_THAT(plan_error(kTiny, {"model.hiden_size=16"}), Contains("(did you mean 'hidden_size'?)"));
  CHECK_THAT(plan_error(kTiny, {"model.tp_size=2"}), Contains("(it belongs in [distributed])"));
  CHECK_THAT(plan_error(kTiny, {"model.num_key_value_heads=3"}),
             StartsWith("override 'model.num_key_value_heads=3': model.num_key_value_heads: "));
  CHECK_THAT(plan_error(kTiny, {"model.hidden_size=24", "model.num_attention_heads=8",
                                "model.num_key_value_heads=8"}),
             Contains("= 3 must be even"));
  CHECK_THAT(plan_error(std::string(kTiny) + "tie_word_embeddings = 1\n"),
             StartsWith("cfg.toml:9:1: model.tie_word_embeddings: expected a boolean (true or "
                        "false), got 1"));
  CHECK_THAT(plan_error(kTiny, {"model.rms_norm_eps=0"}),
             Contains("model.rms_norm_eps: expected a finite number > 0, got 0"));
  CHECK_THAT(plan_error(kTiny, {"model.num_hidden_layers=0"}),
             Contains("model.num_hidden_layers: expected an integer in [1, 2048], got 0"));
  CHECK_THAT(plan_error(kTiny, {"model.rope_theta=inf"}),
             Contains("model.rope_theta: expected a finite number > 0, got \"inf\""));
  CHECK_THAT(plan_error(kTiny, {"model.model_type=gpt9"}),
             Contains("model.model_type: no model plugin named 'gpt9'"));
}

TEST_CASE("model plugin: tied embeddings cannot be split over pipeline stages", "[model]") {
  const std::string pipeline = std::string(kTiny) +
                               "tie_word_embeddings = true\n[distributed]\npp_size = 2\n"
                               "[distributed.pipeline]\n";
  CHECK_THAT(plan_error(pipeline, {}, 2),
             Contains("distributed.pp_size: parameter 'model.embed_tokens.weight' is used by "
                      "modules 'model.embed_tokens' and 'lm_head'"));
}

TEST_CASE("model plugin: llama's description", "[model]") {
  const meshrun::Plan plan = plan_of(kTiny, {"model.num_key_value_heads=4"});
  const meshrun::ModelDescription& d = plan.model->description();
  CHECK(d.config.at("num_key_value_heads") == 4);
  CHECK(d.config.at("architectures") == nlohmann::ordered_json::array({"LlamaForCausalLM"}));
  CHECK(d.units ==
        std::vector<std::string>{"model.layers.0", "model.layers.1", "embedding", "head", "root"});
  CHECK(d.unit_kinds ==
        std::vector<meshrun::UnitKind>{meshrun::UnitKind::layer, meshrun::UnitKind::layer,
                                       meshrun::UnitKind::embedding, meshrun::UnitKind::head,
                                       meshrun::UnitKind::root});
  CHECK(d.parameters.size() == 1 + 2 * 9 + 2);
  CHECK(d.parameters.back().name == "lm_head.weight");
  CHECK(d.parameters.back().unit == 3);
  REQUIRE(d.modules.size() == 5);
  CHECK(d.modules[3].group == "head");
  CHECK(d.vocab_size == 11);
  CHECK_FALSE(d.max_seq_len.has_value());
  CHECK(d.num_layers_key == "model.num_hidden_layers");
  // The default num_key_value_heads is num_attention_heads, as Hugging Face's.
  const meshrun::Plan defaulted = plan_of("[model]\nnum_attention_heads = 4\nhidden_size = 16\n");
  CHECK(defaulted.model->description().config.at("num_key_value_heads") == 4);
}

// The host side a replicated strategy gives: the parameters in one flat
// buffer in description order.
class FlatHooks : public meshrun::StageHooks {
 public:
  explicit FlatHooks(const meshrun::ModelDescription& d)
      : d_(d), values(size_t(d.numel)), gradients(size_t(d.numel)) {}
  ParameterStorage parameter(int64_t parameter, bool backward) override {
    const int64_t offset = d_.parameters[size_t(parameter)].offset;
    return {values.data() + offset, backward ? gradients.data() + offset : nullptr};
  }
  void gradient_ready(int64_t parameter) override { ready.push_back(parameter); }

  const meshrun::ModelDescription& d_;
  std::vector<float> values, gradients;
  std::vector<int64_t> ready;
};

// Through the ABI over FlatHooks, as the trainer drives it: the same
// initial weights, loss and gradients as the model library's own stage.
template <class Family>
void check_stage_matches_library(const meshrun::Plan& plan,
                                 stage_fixture::OwnedModel<Family>& reference) {
  const Model& model = *plan.model;
  const meshrun::ModelDescription& d = model.description();
  FlatHooks hooks(d);
  model.init_parameters(5, hooks.values.data());
  std::vector<std::string> modules;
  for (const auto& module : d.modules) modules.push_back(module.name);
  ModelStage stage(model, modules, hooks, {}, "{}", "{}");

  reference.init_weights(5);
  CHECK(std::vector<float>(reference.param_buffer(),
                           reference.param_buffer() + reference.num_parameters()) == hooks.values);

  const stage_fixture::Batch batch = stage_fixture::random_batch(d.vocab_size, 2, 5, 3);
  stage.set_shape(2, 5);
  CHECK(stage.input_numel() == 0);
  CHECK(stage.output_numel() == 0);
  const double loss = stage.forward(0, batch.tokens.data(), batch.targets.data(), nullptr, nullptr);
  stage.backward(0, 1.0f, nullptr, nullptr);
  CHECK(float(loss) == reference.forward(batch.tokens.data(), batch.targets.data(), 2, 5));
  reference.backward();
  CHECK(hooks.gradients ==
        std::vector<float>(reference.grad_buffer(),
                           reference.grad_buffer() + reference.num_parameters()));
  CHECK(hooks.ready.size() == d.parameters.size());
  CHECK(stage.activation_bytes() == 0);

  std::vector<int32_t> targets = batch.targets;
  targets[0] = int32_t(d.vocab_size);
  CHECK_THROWS_WITH(stage.forward(0, batch.tokens.data(), targets.data(), nullptr, nullptr),
                    Contains("targets[0] = 11 is outside [0, vocab_size 11)"));
  CHECK_THROWS_WITH(stage.backward(0, 1.0f, nullptr, nullptr),
                    Contains("microbatch 0: backward without its forward"));
}

TEST_CASE("model plugin: a stage through the ABI computes what the model library does", "[model]") {
  llama_fixture::OwnedModel reference({11, 16, 12, 2, 4, 2});
  check_stage_matches_library(plan_of(kTiny), reference);
}

// ABI 1.14: a stage lives on its setup's device, and a tensor handed to it
// on another device is refused before any compute, naming the tensor and
// both devices; a stage on a device the model does not compute on is
// refused with UNIMPLEMENTED (also in the conformance suite): Llama's kit
// computes on CUDA only where its GPU compute library was built, which
// this build (the sanitized one, without CUDA) lacks.
TEST_CASE("model plugin: a tensor on another device than the stage's is refused, naming both",
          "[model]") {
  const meshrun::Plan plan = plan_of(kTiny);
  const Model& model = *plan.model;
  const RawStageSetup on_gpu(model, DLDevice{kDLCUDA, 1});
  meshrun_model_stage* stage = nullptr;
  meshrun_error* error = model.api().stage_create(model.handle(), &on_gpu.setup, &stage);
  REQUIRE(error != nullptr);
  CHECK(error->code == MESHRUN_UNIMPLEMENTED);
  CHECK_THAT(std::string(error->message), Contains("device is cuda:1") && Contains("CPU only") &&
                                              Contains("libmeshrun_kit_cuda.so is missing"));
  meshrun_error_release(error);

  const RawStageSetup on_cpu(model, DLDevice{kDLCPU, 0});
  REQUIRE(model.api().stage_create(model.handle(), &on_cpu.setup, &stage) == nullptr);
  int64_t input_numel = 0, output_numel = 0;
  REQUIRE(model.api().set_shape(stage, 1, 2, &input_numel, &output_numel) == nullptr);
  int32_t tokens[2] = {1, 2}, targets[2] = {2, 3};
  int64_t shape[2] = {1, 2};
  DLTensor tokens_on_gpu{tokens, {kDLCUDA, 0}, 2, {kDLInt, 32, 1}, shape, nullptr, 0};
  DLTensor targets_on_cpu{targets, {kDLCPU, 0}, 2, {kDLInt, 32, 1}, shape, nullptr, 0};
  double loss = 0;
  error = model.api().forward(stage, 0, &tokens_on_gpu, &targets_on_cpu, nullptr, nullptr, &loss);
  REQUIRE(error != nullptr);
  CHECK(error->code == MESHRUN_INVALID_ARGUMENT);
  CHECK(std::string(error->message) ==
        "forward: tokens is on cuda:0, and the stage computes on cpu");
  meshrun_error_release(error);
  model.api().stage_destroy(stage);
}

const char* const kTinyGpt2 = R"([model]
model_type = "gpt2"
vocab_size = 11
n_positions = 16
n_embd = 16
n_layer = 2
n_head = 4
)";

TEST_CASE("model plugin: gpt2's keys are checked at plan time, at their place in the file",
          "[model][gpt2]") {
  CHECK_THAT(plan_error(kTinyGpt2, {"model.activation_function=gelu"}),
             StartsWith("override 'model.activation_function=gelu': "
                        "model.activation_function: expected one of 'gelu_new', got \"gelu\""));
  CHECK_THAT(plan_error(std::string(kTinyGpt2) + "resid_pdrop = 0.1\n"),
             StartsWith("cfg.toml:8:1: model.resid_pdrop: expected 0.0 (training here has no "
                        "dropout), got 0.1"));
  CHECK_THAT(plan_error(kTinyGpt2, {"model.attn_pdrop=0.5"}), Contains("model.attn_pdrop: "));
  CHECK_THAT(plan_error(kTinyGpt2, {"model.n_embd=18"}),
             Contains("model.n_embd: 18 must be divisible by model.n_head (4)"));
  CHECK_THAT(plan_error(kTinyGpt2, {"model.n_inner=0"}),
             Contains("model.n_inner: expected an integer >= 1, got 0"));
  CHECK_THAT(plan_error(kTinyGpt2, {"model.hidden_size=16"}),
             StartsWith("override 'model.hidden_size=16': model.hidden_size: unknown key for "
                        "model_type 'gpt2'"));
  CHECK_THAT(plan_error(kTinyGpt2, {"model.layer_norm_epsilon=0"}),
             Contains("model.layer_norm_epsilon: expected a finite number > 0, got 0"));
  const meshrun::Plan zero_dropout =
      plan_of(kTinyGpt2, {"model.resid_pdrop=0.0", "model.embd_pdrop=0", "model.n_inner=24"});
  CHECK(zero_dropout.model->description().config.at("n_inner") == 24);
}

TEST_CASE("model plugin: gpt2's description", "[model][gpt2]") {
  const meshrun::Plan plan = plan_of(kTinyGpt2);
  const meshrun::ModelDescription& d = plan.model->description();
  CHECK(d.config.at("architectures") == nlohmann::ordered_json::array({"GPT2LMHeadModel"}));
  CHECK(d.config.at("model_type") == "gpt2");
  CHECK(d.config.at("n_ctx") == 16);
  CHECK(d.config.at("n_inner") == 64);  // 4 * n_embd, resolved
  CHECK(d.config.at("activation_function") == "gelu_new");
  CHECK(d.config.at("tie_word_embeddings") == true);  // Hugging Face's GPT-2 default
  CHECK(d.config.at("resid_pdrop") == 0.0);
  CHECK(d.units == std::vector<std::string>{"transformer.h.0", "transformer.h.1", "embedding",
                                            "head", "root"});
  CHECK(d.parameters.front().unit == 4);  // wte, tied: in the root, read by embedding and head
  REQUIRE(d.parameters.size() == 2 + 2 * 12 + 2);  // tied: no lm_head.weight
  CHECK(d.parameters.back().name == "transformer.ln_f.bias");
  CHECK(d.parameters[2].name == "transformer.h.0.ln_1.weight");
  CHECK(d.parameters[4].shape == std::vector<int64_t>{16, 48});  // c_attn, Conv1D [in, out]
  std::vector<std::string> modules, groups;
  for (const auto& module : d.modules) {
    modules.push_back(module.name);
    groups.push_back(module.group);
  }
  CHECK(modules == std::vector<std::string>{"transformer.wte", "transformer.wpe", "transformer.h.0",
                                            "transformer.h.1", "transformer.ln_f", "lm_head"});
  CHECK(groups == std::vector<std::string>{"embeddings", "embeddings", "", "", "head", "head"});
  CHECK(d.modules.back().parameters == std::vector<int64_t>{0});  // the tied lm_head uses wte
  CHECK(d.vocab_size == 11);
  CHECK(d.max_seq_len == 16);
  CHECK(d.num_layers_key == "model.n_layer");

  const meshrun::Plan untied = plan_of(kTinyGpt2, {"model.tie_word_embeddings=false"});
  CHECK(untied.model->description().parameters.back().name == "lm_head.weight");
  CHECK(untied.model->description().parameters.back().shape == std::vector<int64_t>{11, 16});
}

TEST_CASE("model plugin: gpt2's tied embeddings cannot be split over pipeline stages",
          "[model][gpt2]") {
  const std::string pipeline =
      std::string(kTinyGpt2) + "[distributed]\npp_size = 2\n[distributed.pipeline]\n";
  CHECK_THAT(plan_error(pipeline, {}, 2),
             Contains("distributed.pp_size: parameter 'transformer.wte.weight' is used by "
                      "modules 'transformer.wte' and 'lm_head'"));
  CHECK(plan_of(pipeline, {"model.tie_word_embeddings=false"}, 2).model != nullptr);
}

TEST_CASE("model plugin: a gpt2 stage through the ABI computes what the model library does",
          "[model][gpt2]") {
  const bool tied = GENERATE(true, false);
  meshrun::gpt2::Gpt2Config config;
  config.vocab_size = 11;
  config.n_positions = 16;
  config.n_embd = 16;
  config.n_layer = 2;
  config.n_head = 4;
  config.n_inner = 64;
  config.tie_word_embeddings = tied;
  stage_fixture::OwnedModel<meshrun::gpt2::Gpt2> reference(config);
  check_stage_matches_library(
      plan_of(kTinyGpt2, {"model.tie_word_embeddings=" + std::string(tied ? "true" : "false")}),
      reference);
}

}  // namespace
