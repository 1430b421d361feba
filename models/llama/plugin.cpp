// The Llama model plugin (meshrun/model.h, model_type "llama"): the
// configuration from [model], the description (parameters, units, modules,
// the Hugging Face config.json) and stages of the model over the host's
// hooks.
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "common/config_reader.hpp"
#include "llama/model.hpp"
#include "llama/stage.hpp"
#include "meshrun/model.hpp"

namespace {

using meshrun::llama::LlamaConfig;
using meshrun::llama::LlamaStage;
using meshrun::llama::ParameterView;
using meshrun::llama::StageLayout;
using meshrun::plugin::Error;
using nlohmann::ordered_json;

const char* const kConfigKeys[] = {"vocab_size",
                                   "hidden_size",
                                   "intermediate_size",
                                   "num_hidden_layers",
                                   "num_attention_heads",
                                   "num_key_value_heads",
                                   "max_position_embeddings",
                                   "rms_norm_eps",
                                   "rope_theta",
                                   "tie_word_embeddings",
                                   nullptr};

LlamaConfig read_config(const char* config_json) {
  const meshrun::models::ConfigReader reader(config_json);
  LlamaConfig c;
  c.vocab_size = reader.integer("vocab_size", c.vocab_size);
  c.hidden_size = reader.integer("hidden_size", c.hidden_size);
  c.intermediate_size = reader.integer("intermediate_size", c.intermediate_size);
  c.num_hidden_layers = reader.integer("num_hidden_layers", c.num_hidden_layers);
  c.num_attention_heads = reader.integer("num_attention_heads", c.num_attention_heads);
  // Hugging Face's default: one key/value head per attention head.
  c.num_key_value_heads = reader.integer("num_key_value_heads", c.num_attention_heads);
  c.max_position_embeddings = reader.integer("max_position_embeddings", c.max_position_embeddings);
  c.rms_norm_eps = reader.positive_number("rms_norm_eps", c.rms_norm_eps);
  c.rope_theta = reader.positive_number("rope_theta", c.rope_theta);
  c.tie_word_embeddings = reader.boolean("tie_word_embeddings", c.tie_word_embeddings);
  meshrun::llama::check_config(c);
  return c;
}

ordered_json hf_config(const LlamaConfig& c) {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"vocab_size", c.vocab_size},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.num_hidden_layers},
          {"num_attention_heads", c.num_attention_heads},
          {"num_key_value_heads", c.num_key_value_heads},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"head_dim", c.hidden_size / c.num_attention_heads},
          {"hidden_act", "silu"},
          {"max_position_embeddings", c.max_position_embeddings},
          {"rms_norm_eps", c.rms_norm_eps},
          {"rope_theta", c.rope_theta},
          {"attention_bias", false},
          {"mlp_bias", false}};
}

class LlamaModel {
 public:
  LlamaModel(const meshrun_host_services& host, const char* config_json)
      : host_(host),
        config_(read_config(config_json)),
        parameters_(meshrun::llama::model_parameters(config_)) {}

  const meshrun_host_services& host() const { return host_; }
  const LlamaConfig& config() const { return config_; }

  // Units: the layers in order, then the root; modules: the embedding, the
  // layers, and the head (final norm and lm_head, inseparable: the loss
  // needs both).
  std::string describe() const {
    ordered_json units = ordered_json::array();
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) units.push_back(layer(l));
    units.push_back("root");
    ordered_json parameters = ordered_json::array();
    ordered_json modules = ordered_json::array();
    modules.push_back({{"name", "model.embed_tokens"}, {"parameters", {parameters_[0].name}}});
    for (const ParameterView& p : parameters_) {
      const bool root = p.unit == meshrun::llama::root_unit(config_);
      parameters.push_back(
          {{"name", p.name}, {"shape", p.shape}, {"unit", root ? "root" : layer(p.unit)}});
      if (root) continue;
      if (modules.back()["name"] != layer(p.unit)) {
        modules.push_back({{"name", layer(p.unit)}, {"parameters", ordered_json::array()}});
      }
      modules.back()["parameters"].push_back(p.name);
    }
    const std::string lm_head =
        config_.tie_word_embeddings ? parameters_[0].name : "lm_head.weight";
    modules.push_back(
        {{"name", "model.norm"}, {"parameters", {"model.norm.weight"}}, {"group", "head"}});
    modules.push_back({{"name", "lm_head"}, {"parameters", {lm_head}}, {"group", "head"}});
    return ordered_json{{"config", hf_config(config_)},
                        {"parameters", std::move(parameters)},
                        {"units", std::move(units)},
                        {"modules", std::move(modules)},
                        {"vocab_size", config_.vocab_size},
                        {"max_seq_len", nullptr},
                        {"num_layers_key", "num_hidden_layers"}}
        .dump();
  }

  void init_parameter(uint64_t seed, int64_t parameter, float* values) const {
    if (parameter < 0 || parameter >= int64_t(parameters_.size())) {
      throw Error(MESHRUN_OUT_OF_RANGE,
                  "llama: init_parameter: no parameter " + std::to_string(parameter));
    }
    meshrun::llama::init_parameter(parameters_, seed, parameter, values);
  }

 private:
  static std::string layer(int64_t l) { return "model.layers." + std::to_string(l); }

  const meshrun_host_services& host_;
  LlamaConfig config_;
  std::vector<ParameterView> parameters_;
};

// The layout of a stage from its module names (a contiguous run of the
// description's modules, which the host checked).
StageLayout layout_of(const LlamaConfig& config, const meshrun_model_stage_setup& setup) {
  StageLayout layout{-1, -1, false, false};
  bool norm = false;
  const std::string prefix = "model.layers.";
  for (int64_t m = 0; m < setup.num_modules; ++m) {
    const std::string name = setup.modules[m] != nullptr ? setup.modules[m] : "";
    if (name == "model.embed_tokens") {
      layout.embedding = true;
    } else if (name == "model.norm") {
      norm = true;
    } else if (name == "lm_head") {
      layout.head = true;
    } else if (name.rfind(prefix, 0) == 0) {
      const int64_t l = std::stoll(name.substr(prefix.size()));
      if (layout.first_layer < 0) layout.first_layer = l;
      layout.end_layer = l + 1;
    } else {
      throw Error(MESHRUN_INVALID_ARGUMENT, "llama: no module '" + name + "'");
    }
  }
  if (norm != layout.head) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                "llama: model.norm and lm_head must be on one stage (the loss needs both)");
  }
  if (layout.first_layer < 0)
    layout.first_layer = layout.end_layer = layout.embedding ? 0 : config.num_hidden_layers;
  return layout;
}

// The host's hooks, as the Llama stage calls them.
class HostHooks : public meshrun::llama::StageHooks {
 public:
  explicit HostHooks(const meshrun_model_hooks& hooks) : hooks_(hooks) {}
  void pre_forward(int64_t unit, float* hidden, int64_t numel) override {
    hooks_.pre_forward(int32_t(unit), hidden, numel);
  }
  void post_forward(int64_t unit, float* hidden, int64_t numel) override {
    hooks_.post_forward(int32_t(unit), hidden, numel);
  }
  void pre_backward(int64_t unit) override { hooks_.pre_backward(int32_t(unit)); }
  void post_backward(int64_t unit) override { hooks_.post_backward(int32_t(unit)); }
  void gradient_ready(int64_t parameter) override { hooks_.gradient_ready(parameter); }
  void bind(ParameterView& view, bool backward) override {
    const auto [values, gradient] = hooks_.parameter(view.index);
    view.data = values;
    view.grad = backward ? gradient : nullptr;
  }

 private:
  meshrun::plugin::ModelHooks hooks_;
};

class Stage {
 public:
  Stage(LlamaModel& model, const meshrun_model_stage_setup& setup)
      : hooks_(*setup.hooks), stage_(model.config(), layout_of(model.config(), setup), hooks_) {}

  void set_shape(int64_t batch, int64_t seq_len, int64_t* input_numel, int64_t* output_numel) {
    stage_.set_shape(batch, seq_len);
    *input_numel = stage_.input_numel();
    *output_numel = stage_.output_numel();
  }
  double forward(int32_t mb, const int32_t* tokens, const int32_t* targets, const float* input,
                 float* output) {
    return stage_.forward(mb, tokens, targets, input, output);
  }
  void backward(int32_t mb, float loss_scale, const float* grad_output, float* grad_input) {
    stage_.backward(mb, loss_scale, grad_output, grad_input);
  }
  void backward_input(int32_t mb, float loss_scale, const float* grad_output, float* grad_input) {
    stage_.backward_input(mb, loss_scale, grad_output, grad_input);
  }
  void backward_weight(int32_t mb) { stage_.backward_weight(mb); }
  void discard(int32_t mb) { stage_.discard(mb); }
  int64_t activation_bytes() const { return stage_.activation_bytes(); }

 private:
  HostHooks hooks_;
  LlamaStage stage_;
};

const meshrun_model_api kModelApi =
    meshrun::plugin::ModelTable<LlamaModel, Stage>::make("llama", kConfigKeys);

const meshrun_plugin_api kApi = [] {
  meshrun_plugin_api api{};
  api.struct_size = sizeof(meshrun_plugin_api);
  api.abi_major = MESHRUN_ABI_VERSION_MAJOR;
  api.abi_minor = MESHRUN_ABI_VERSION_MINOR;
  api.kind = MESHRUN_PLUGIN_KIND_MODEL;
  api.name = "llama";
  api.version = MESHRUN_PLUGIN_VERSION;
  api.description =
      "Llama (LlamaForCausalLM): RMSNorm, rotary attention with grouped key/value heads, "
      "SwiGLU; float32 compute through OpenBLAS; pipeline stages with split backward";
  api.create = &meshrun::plugin::create_instance<meshrun::plugin::HostServicesOnly>;
  api.destroy = &meshrun::plugin::destroy_instance<meshrun::plugin::HostServicesOnly>;
  api.model = &kModelApi;
  return api;
}();

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
