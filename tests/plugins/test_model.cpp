// The test model: the smallest model plugin that trains, so that the test
// sidecars of the same name (test_sidecar.cpp) have a model to plan, and the
// conformance suite a model to check. plugin_name.hpp names it.
//
// A unigram model: logits = scale * bias over the 256 byte values, the same
// for every position; loss = mean cross-entropy of the targets. Parameters:
// "layers.0.scale" [1] (unit "layers.0", module "layers.0") and "bias" [256]
// (the root, module "head").
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "meshrun/model.hpp"
#include "plugin_name.hpp"

namespace {

using meshrun::plugin::Error;
using test_plugins::kPluginName;

constexpr int64_t kVocab = 256;
constexpr int64_t kScale = 0, kBias = 1;  // parameter indices
constexpr int32_t kLayer = 0, kRoot = 1;  // unit indices

class TestModel {
 public:
  // It takes no key: the config must be an empty JSON object.
  TestModel(const meshrun_host_services& host, const char* config_json) : host_(host) {
    const auto config = nlohmann::json::parse(config_json, nullptr, false);
    if (!config.is_object() || !config.empty()) {
      throw std::invalid_argument(std::string("model: ") + kPluginName + " takes no [model] key");
    }
  }
  const meshrun_host_services& host() const { return host_; }

  std::string describe() const {
    return R"({"config": {"model_type": ")" + std::string(kPluginName) + R"("},
      "parameters": [{"name": "layers.0.scale", "shape": [1], "unit": "layers.0"},
                     {"name": "bias", "shape": [256], "unit": "root"}],
      "units": ["layers.0", "root"],
      "modules": [{"name": "layers.0", "parameters": ["layers.0.scale"]},
                  {"name": "head", "parameters": ["bias"]}],
      "vocab_size": 256})";
  }
  void init_parameter(uint64_t seed, int64_t parameter, float* values) const {
    if (parameter == kScale) {
      values[0] = 1.0f;
      return;
    }
    for (int64_t v = 0; v < kVocab; ++v) values[v] = float((seed + uint64_t(v)) % 7) * 0.01f;
  }

 private:
  const meshrun_host_services& host_;
};

// p = softmax(s b); dL/db_v = s (mean_r p_v - [v = t_r]), dL/ds = b . (that / s).
class TestStage {
 public:
  TestStage(TestModel& /*model*/, const meshrun_model_stage_setup& setup) : hooks_(*setup.hooks) {}

  void set_shape(int64_t batch, int64_t seq_len, int64_t* input_numel, int64_t* output_numel) {
    rows_ = batch * seq_len;
    *input_numel = *output_numel = 0;
  }
  double forward(int32_t mb, const int32_t* /*tokens*/, const int32_t* targets,
                 const float* /*input*/, float* /*output*/) {
    if (in_flight_.count(mb)) throw std::logic_error("microbatch already in flight");
    hooks_.pre_forward(kRoot, nullptr, 0);
    hooks_.pre_forward(kLayer, nullptr, 0);
    const float scale = hooks_.parameter(kScale).first[0];
    hooks_.post_forward(kLayer, nullptr, 0);
    const float* bias = hooks_.parameter(kBias).first;
    std::vector<double> probabilities(kVocab);
    double sum = 0;
    for (int64_t v = 0; v < kVocab; ++v)
      sum += probabilities[v] = std::exp(double(scale * bias[v]));
    for (double& p : probabilities) p /= sum;
    double loss = 0;
    std::vector<double> counts(kVocab, 0.0);
    for (int64_t r = 0; r < rows_; ++r) {
      if (targets[r] < 0 || targets[r] >= kVocab) throw std::out_of_range("target outside 0..255");
      loss -= std::log(probabilities[size_t(targets[r])]);
      counts[size_t(targets[r])] += 1.0 / double(rows_);
    }
    hooks_.post_forward(kRoot, nullptr, 0);
    in_flight_[mb] = {probabilities, counts};
    return loss / double(rows_);
  }
  void backward(int32_t mb, float loss_scale, const float* /*grad_output*/, float* /*grad_input*/) {
    const auto found = in_flight_.find(mb);
    if (found == in_flight_.end()) throw std::logic_error("backward without its forward");
    const auto& [probabilities, counts] = found->second;
    hooks_.pre_backward(kRoot);
    const auto [bias, bias_grad] = hooks_.parameter(kBias);
    hooks_.pre_backward(kLayer);
    const auto [scale, scale_grad] = hooks_.parameter(kScale);
    double d_scale = 0;
    for (int64_t v = 0; v < kVocab; ++v) {
      const double d_logit = loss_scale * (probabilities[size_t(v)] - counts[size_t(v)]);
      bias_grad[v] += float(d_logit * scale[0]);
      d_scale += d_logit * bias[v];
    }
    scale_grad[0] += float(d_scale);
    hooks_.gradient_ready(kScale);
    hooks_.post_backward(kLayer);
    hooks_.gradient_ready(kBias);
    hooks_.post_backward(kRoot);
    in_flight_.erase(found);
  }
  void discard(int32_t mb) {
    if (in_flight_.erase(mb) == 0) throw std::logic_error("discard of a microbatch not in flight");
  }
  int64_t activation_bytes() const { return int64_t(in_flight_.size()) * 2 * kVocab * 8; }

 private:
  meshrun::plugin::ModelHooks hooks_;
  int64_t rows_ = 0;
  std::map<int32_t, std::pair<std::vector<double>, std::vector<double>>> in_flight_;
};

const char* const kNoKeys[] = {nullptr};

const meshrun_model_api kModelApi =
    meshrun::plugin::ModelTable<TestModel, TestStage>::make(kPluginName, kNoKeys);

const std::string kDescription =
    std::string("test model: a unigram model over bytes, for ") + kPluginName;

const meshrun_plugin_api kApi = [] {
  meshrun_plugin_api api{};
  api.struct_size = sizeof(meshrun_plugin_api);
  api.abi_major = MESHRUN_ABI_VERSION_MAJOR;
  api.abi_minor = MESHRUN_ABI_VERSION_MINOR;
  api.kind = MESHRUN_PLUGIN_KIND_MODEL;
  api.name = kPluginName;
  api.version = "0.0.1-test";
  api.description = kDescription.c_str();
  api.create = &meshrun::plugin::create_instance<meshrun::plugin::HostServicesOnly>;
  api.destroy = &meshrun::plugin::destroy_instance<meshrun::plugin::HostServicesOnly>;
  api.model = &kModelApi;
  return api;
}();

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
