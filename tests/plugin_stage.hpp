// One micro-batch through a model plugin's whole-model stage as the
// trainer drives it (the core's ModelStage), on any device: for the tests
// that run the shipped kit models on a CUDA stage (tests/gpu on a GPU,
// tests/kit on the CPU's fenced stand-in) against the same on the CPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/model.hpp"

namespace plugin_stage {

constexpr int64_t kBatch = 2, kSeqLen = 8;

// Tiny [model] tables of the shipped kit models.
inline nlohmann::ordered_json llama_config() {
  return {{"vocab_size", 64},       {"hidden_size", 32},        {"intermediate_size", 48},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}};
}
inline nlohmann::ordered_json gpt2_config() {
  return {{"vocab_size", 64}, {"n_positions", 16}, {"n_embd", 32},
          {"n_layer", 2},     {"n_head", 4},       {"n_inner", 64}};
}
inline nlohmann::ordered_json mixtral_config() {
  nlohmann::ordered_json config = llama_config();
  config["num_local_experts"] = 4;
  config["num_experts_per_tok"] = 2;
  return config;
}

// The plan JSON of a float32 run or of one under bfloat16 autocast.
inline std::string plan_json(bool bfloat16) {
  return bfloat16 ? R"({"autocast_dtype": "bfloat16"})" : "{}";
}

// Token ids spread over the vocabulary, [kBatch, kSeqLen].
inline std::vector<int32_t> token_ids(int64_t vocab_size, int64_t stride, int64_t offset) {
  std::vector<int32_t> ids(size_t(kBatch * kSeqLen));
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = int32_t((stride * int64_t(i) + offset) % vocab_size);
  }
  return ids;
}

// Hooks handing out the parameters and gradients of one flat buffer each
// (memory of the stage's device), at the description's offsets.
class FlatHooks : public meshrun::StageHooks {
 public:
  FlatHooks(const meshrun::ModelDescription& d, float* values, float* gradients)
      : d_(d), values_(values), gradients_(gradients) {}
  meshrun::ParameterStorage parameter(int64_t p, bool backward) override {
    const int64_t offset = d_.parameters[size_t(p)].offset;
    return {values_ + offset, backward ? gradients_ + offset : nullptr};
  }

 private:
  const meshrun::ModelDescription& d_;
  float* values_;
  float* gradients_;
};

inline std::vector<std::string> all_modules(const meshrun::Model& model) {
  std::vector<std::string> modules;
  for (const auto& module : model.description().modules) modules.push_back(module.name);
  return modules;
}

// One forward and backward of the whole model on `device`, every pointer
// that device's memory; the loss. The gradients are in `gradients` once the
// device's stream has caught up.
inline double step(const meshrun::Model& model, const meshrun::StageDevice& device,
                   const std::string& plan, float* values, float* gradients, const int32_t* tokens,
                   const int32_t* targets) {
  FlatHooks hooks(model.description(), values, gradients);
  meshrun::ModelStage stage(model, all_modules(model), hooks, {}, plan, "{}", nullptr, device);
  stage.set_shape(kBatch, kSeqLen);
  const double loss = stage.forward(0, tokens, targets, nullptr, nullptr);
  stage.backward(0, 1.0f, nullptr, nullptr);
  return loss;
}

// A micro-batch for a model, and its loss and gradients on the CPU: the
// reference a stage on another device must reproduce.
struct Reference {
  std::vector<float> initial;
  std::vector<int32_t> tokens, targets;
  std::string plan;
  double loss = 0;
  std::vector<float> gradients;
};

inline Reference cpu_reference(const meshrun::Model& model, bool bfloat16) {
  const meshrun::ModelDescription& d = model.description();
  Reference made;
  made.initial.resize(size_t(d.numel));
  model.init_parameters(3, made.initial.data());
  made.tokens = token_ids(d.vocab_size, 7, 3);
  made.targets = token_ids(d.vocab_size, 5, 1);
  made.plan = plan_json(bfloat16);
  std::vector<float> values = made.initial;
  made.gradients.resize(values.size());
  made.loss = step(model, {}, made.plan, values.data(), made.gradients.data(), made.tokens.data(),
                   made.targets.data());
  return made;
}

}  // namespace plugin_stage
