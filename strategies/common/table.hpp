// The tables of a strategy plugin written in C++: class T implements the
// entry points as methods of the same names and gives its name as T::kName;
// these build its function tables, every entry turning exceptions into
// errors named after the strategy (errors.hpp).
#pragma once

#include "common/errors.hpp"
#include "meshrun/strategy.h"

namespace meshrun::strategies {

template <class T>
struct Entries {
  template <class Body>
  static meshrun_error* on(meshrun_plugin_instance* instance, Body&& body) noexcept {
    return on_instance<T>(T::kName, instance, body);
  }

  // ABI 1.2
  static meshrun_error* setup(meshrun_plugin_instance* i, const meshrun_strategy_setup* setup) {
    return on(i, [&](T& t) { t.setup(setup); });
  }
  static meshrun_error* broadcast_parameters(meshrun_plugin_instance* i) {
    return on(i, [&](T& t) { t.broadcast_parameters(); });
  }
  static meshrun_error* begin_micro_batch(meshrun_plugin_instance* i, int32_t sync) {
    return on(i, [&](T& t) { t.begin_micro_batch(sync != 0); });
  }
  static meshrun_error* gradients_ready(meshrun_plugin_instance* i, int64_t begin, int64_t end) {
    return on(i, [&](T& t) { t.gradients_ready(begin, end); });
  }
  static meshrun_error* finish_gradients(meshrun_plugin_instance* i) {
    return on(i, [&](T& t) { t.finish_gradients(); });
  }
  static meshrun_error* memory(meshrun_plugin_instance* i, meshrun_strategy_memory* out) {
    return on(i, [&](T& t) { t.memory(out); });
  }

  // ABI 1.3
  static meshrun_error* pre_forward(meshrun_plugin_instance* i, int32_t unit) {
    return on(i, [&](T& t) { t.pre_forward(unit); });
  }
  static meshrun_error* post_forward(meshrun_plugin_instance* i, int32_t unit) {
    return on(i, [&](T& t) { t.post_forward(unit); });
  }
  static meshrun_error* pre_backward(meshrun_plugin_instance* i, int32_t unit) {
    return on(i, [&](T& t) { t.pre_backward(unit); });
  }
  static meshrun_error* post_backward(meshrun_plugin_instance* i, int32_t unit) {
    return on(i, [&](T& t) { t.post_backward(unit); });
  }
  static meshrun_error* unit_views(meshrun_plugin_instance* i, int32_t unit, DLTensor* parameters,
                                   DLTensor* gradients) {
    return on(i, [&](T& t) { t.unit_views(unit, parameters, gradients); });
  }
  static meshrun_error* local_shard(meshrun_plugin_instance* i, DLTensor* parameters,
                                    DLTensor* gradients) {
    return on(i, [&](T& t) { t.local_shard(parameters, gradients); });
  }
  static meshrun_error* shard_segments(meshrun_plugin_instance* i, meshrun_shard_segment* segments,
                                       int64_t capacity, int64_t* count) {
    return on(i, [&](T& t) { t.shard_segments(segments, capacity, count); });
  }
  static meshrun_error* gather_parameters(meshrun_plugin_instance* i, DLTensor* full) {
    return on(i, [&](T& t) { t.gather_parameters(full); });
  }

  // ABI 1.12
  static meshrun_error* unit_views_bfloat16(meshrun_plugin_instance* i, int32_t unit,
                                            DLTensor* parameters) {
    return on(i, [&](T& t) { t.unit_views_bfloat16(unit, parameters); });
  }

  // ABI 1.6
  static meshrun_error* plan_memory(meshrun_plugin_instance* i,
                                    const meshrun_strategy_plan_input* input,
                                    meshrun_strategy_memory_plan* out) {
    return on(i, [&](T& t) { t.plan_memory(input, out); });
  }
};

// The ABI 1.6 strategy table of a replicated strategy (the entries of 1.2,
// and plan_memory). Built field by field from a zeroed table, so fields
// appended by later ABI minors need no initializer here.
template <class T>
meshrun_strategy_api replicated_strategy_table(int32_t mesh_family) {
  meshrun_strategy_api api{};
  api.struct_size = MESHRUN_STRATEGY_API_SIZE_1_6;
  api.mesh_family = mesh_family;
  api.setup = &Entries<T>::setup;
  api.broadcast_parameters = &Entries<T>::broadcast_parameters;
  api.begin_micro_batch = &Entries<T>::begin_micro_batch;
  api.gradients_ready = &Entries<T>::gradients_ready;
  api.finish_gradients = &Entries<T>::finish_gradients;
  api.memory = &Entries<T>::memory;
  api.plan_memory = &Entries<T>::plan_memory;
  return api;
}

// The ABI 1.12 strategy table of a sharded strategy: every entry set, and
// setups with weights by shard taken.
template <class T>
meshrun_strategy_api sharded_strategy_table(int32_t mesh_family) {
  meshrun_strategy_api api = replicated_strategy_table<T>(mesh_family);
  api.struct_size = MESHRUN_STRATEGY_API_SIZE_1_12;
  api.unit_views_bfloat16 = &Entries<T>::unit_views_bfloat16;
  api.pre_forward = &Entries<T>::pre_forward;
  api.post_forward = &Entries<T>::post_forward;
  api.pre_backward = &Entries<T>::pre_backward;
  api.post_backward = &Entries<T>::post_backward;
  api.unit_views = &Entries<T>::unit_views;
  api.local_shard = &Entries<T>::local_shard;
  api.shard_segments = &Entries<T>::shard_segments;
  api.gather_parameters = &Entries<T>::gather_parameters;
  api.weights_by_shard = 1;
  return api;
}

// The plugin table of a strategy whose instances are T objects.
template <class T>
meshrun_plugin_api strategy_plugin_table(const char* name, const char* version,
                                         const char* description,
                                         const meshrun_strategy_api* strategy) {
  meshrun_plugin_api api{};
  api.struct_size = sizeof(meshrun_plugin_api);
  api.abi_major = MESHRUN_ABI_VERSION_MAJOR;
  api.abi_minor = MESHRUN_ABI_VERSION_MINOR;
  api.kind = MESHRUN_PLUGIN_KIND_STRATEGY;
  api.name = name;
  api.version = version;
  api.description = description;
  api.create = &meshrun::plugin::create_instance<T>;
  api.destroy = &meshrun::plugin::destroy_instance<T>;
  api.strategy = strategy;
  return api;
}

}  // namespace meshrun::strategies
