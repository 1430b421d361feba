// A sharded strategy (ABI 1.3) whose unit_views and local_shard hand back
// views broken in the one way its options name ({"break": "dtype"}; "none"
// breaks nothing), for the core's checks of what a strategy returns
// (tests/unit/test_strategy_views.cpp). It communicates nothing: its local
// shard is every parameter, and its unit views are buffers of their own.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshrun/plugin.hpp"

namespace {

using meshrun::plugin::Error;

class BrokenViews {
 public:
  explicit BrokenViews(const meshrun_host_services& /*host*/) {}

  void setup(const meshrun_strategy_setup& setup) {
    mode_ = nlohmann::json::parse(setup.options_json).at("break").get<std::string>();
    unit_numel_.assign(static_cast<size_t>(setup.num_units), 0);
    for (int64_t p = 0; p < setup.num_parameters; ++p) {
      unit_numel_.at(static_cast<size_t>(setup.parameter_units[p])) +=
          setup.parameter_offsets[p + 1] - setup.parameter_offsets[p];
    }
    in_backward_.assign(unit_numel_.size(), false);
    shard_numel_ = setup.parameter_offsets[setup.num_parameters];
    // Unit views are no larger than the shard; one more element for the
    // views that claim one too many.
    parameters_.assign(static_cast<size_t>(shard_numel_ + 1), 0.0f);
    gradients_.assign(static_cast<size_t>(shard_numel_ + 1), 0.0f);
  }

  void set_backward(int32_t unit, bool in_backward) {
    in_backward_.at(unit_index(unit)) = in_backward;
  }

  void unit_views(int32_t unit, DLTensor* parameters, DLTensor* gradients) {
    const int64_t numel = unit_numel_.at(unit_index(unit));
    parameter_shape_ = mode_ == "unit_length" ? numel + 1 : numel;
    gradient_shape_ = mode_ == "gradient_length" ? numel - 1 : numel;
    *parameters = view(mode_ == "null_parameters" ? nullptr : parameters_.data(), parameter_shape_);
    if (mode_ == "dtype") parameters->dtype = {kDLFloat, 16, 1};
    if (mode_ == "device") parameters->device = {kDLCUDA, 0};
    if (mode_ == "ndim") parameters->ndim = 2;
    if (mode_ == "strides") parameters->strides = &stride_two_;
    const bool gradients_exist = in_backward_.at(unit_index(unit)) && mode_ != "null_gradients";
    *gradients = view(gradients_exist ? gradients_.data() : nullptr, gradient_shape_);
  }

  void local_shard(DLTensor* parameters, DLTensor* gradients) {
    shard_parameter_shape_ = shard_numel_;
    shard_gradient_shape_ = mode_ == "shard_length" ? shard_numel_ + 1 : shard_numel_;
    *parameters = view(parameters_.data(), shard_parameter_shape_);
    *gradients =
        view(mode_ == "shard_null_gradients" ? nullptr : gradients_.data(), shard_gradient_shape_);
  }

 private:
  size_t unit_index(int32_t unit) const {
    if (unit < 0 || static_cast<size_t>(unit) >= unit_numel_.size()) {
      throw Error(MESHRUN_OUT_OF_RANGE, "unit " + std::to_string(unit) + " is out of range");
    }
    return static_cast<size_t>(unit);
  }

  // A flat float32 host view of `shape` (whose storage outlives it) at `data`.
  static DLTensor view(float* data, int64_t& shape) {
    return DLTensor{data, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
  }

  std::string mode_;
  std::vector<int64_t> unit_numel_;
  std::vector<bool> in_backward_;
  int64_t shard_numel_ = 0;
  std::vector<float> parameters_;
  std::vector<float> gradients_;
  // The views' shapes and strides: valid until the next call, as views are.
  int64_t parameter_shape_ = 0;
  int64_t gradient_shape_ = 0;
  int64_t shard_parameter_shape_ = 0;
  int64_t shard_gradient_shape_ = 0;
  int64_t stride_two_ = 2;
};

template <class Body>
meshrun_error* on_instance(meshrun_plugin_instance* instance, Body&& body) noexcept {
  return meshrun::plugin::guard([&] {
    if (instance == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, "instance is NULL");
    body(*reinterpret_cast<BrokenViews*>(instance));
  });
}

meshrun_error* setup(meshrun_plugin_instance* instance, const meshrun_strategy_setup* setup) {
  return on_instance(instance, [&](BrokenViews& s) { s.setup(*setup); });
}

meshrun_error* nothing(meshrun_plugin_instance* instance) {
  return on_instance(instance, [](BrokenViews&) {});
}

meshrun_error* begin_micro_batch(meshrun_plugin_instance* instance, int32_t /*sync*/) {
  return nothing(instance);
}

meshrun_error* gradients_ready(meshrun_plugin_instance* instance, int64_t /*begin*/,
                               int64_t /*end*/) {
  return nothing(instance);
}

meshrun_error* memory(meshrun_plugin_instance* instance, meshrun_strategy_memory* /*out*/) {
  return nothing(instance);
}

meshrun_error* forward_hook(meshrun_plugin_instance* instance, int32_t /*unit*/) {
  return nothing(instance);
}

meshrun_error* pre_backward(meshrun_plugin_instance* instance, int32_t unit) {
  return on_instance(instance, [&](BrokenViews& s) { s.set_backward(unit, true); });
}

meshrun_error* post_backward(meshrun_plugin_instance* instance, int32_t unit) {
  return on_instance(instance, [&](BrokenViews& s) { s.set_backward(unit, false); });
}

meshrun_error* unit_views(meshrun_plugin_instance* instance, int32_t unit, DLTensor* parameters,
                          DLTensor* gradients) {
  return on_instance(instance, [&](BrokenViews& s) { s.unit_views(unit, parameters, gradients); });
}

meshrun_error* local_shard(meshrun_plugin_instance* instance, DLTensor* parameters,
                           DLTensor* gradients) {
  return on_instance(instance, [&](BrokenViews& s) { s.local_shard(parameters, gradients); });
}

meshrun_error* shard_segments(meshrun_plugin_instance* instance,
                              meshrun_shard_segment* /*segments*/, int64_t /*capacity*/,
                              int64_t* count) {
  return on_instance(instance, [&](BrokenViews&) { *count = 0; });
}

meshrun_error* gather_parameters(meshrun_plugin_instance* instance, DLTensor* /*full*/) {
  return nothing(instance);
}

const meshrun_strategy_api kStrategyApi = [] {
  meshrun_strategy_api api{};
  api.struct_size = MESHRUN_STRATEGY_API_SIZE_1_3;
  api.mesh_family = MESHRUN_MESH_FAMILY_FSDP2;
  api.setup = &setup;
  api.broadcast_parameters = &nothing;
  api.begin_micro_batch = &begin_micro_batch;
  api.gradients_ready = &gradients_ready;
  api.finish_gradients = &nothing;
  api.memory = &memory;
  api.pre_forward = &forward_hook;
  api.post_forward = &forward_hook;
  api.pre_backward = &pre_backward;
  api.post_backward = &post_backward;
  api.unit_views = &unit_views;
  api.local_shard = &local_shard;
  api.shard_segments = &shard_segments;
  api.gather_parameters = &gather_parameters;
  return api;
}();

const meshrun_plugin_api kApi = {
    sizeof(meshrun_plugin_api),
    MESHRUN_ABI_VERSION_MAJOR,
    MESHRUN_ABI_VERSION_MINOR,
    MESHRUN_PLUGIN_KIND_STRATEGY,
    "broken_views",
    "0.0.1-test",
    "test plugin: a sharded strategy that hands back broken views",
    &meshrun::plugin::create_instance<BrokenViews>,
    &meshrun::plugin::destroy_instance<BrokenViews>,
    &kStrategyApi,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
