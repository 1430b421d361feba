// What the tests of the sharding engine's GPU code paths on host memory
// share (unit/test_sharding_device_paths.cpp on one rank,
// strategy/sharding_device_paths_test.cpp on four).
//
// On a CUDA device the engine enqueues a gather's unpacking and a
// reduction's add into the local shard when the collective starts, keeps
// gathers' requests until they complete, and makes the compute stream wait
// for a unit's gather before the unit computes (strategies/common/device.hpp).
// OrderedHostDevice says that it orders work after collectives, as a stream
// does, but computes at once; over a comm whose collectives are complete
// when their call returns, every result is there when it reads it, so the
// engine's device paths run on host memory and must give the host device's
// bits: the same kernels on the same numbers in the same order.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "common/device.hpp"
#include "fsdp2_setup.hpp"
#include "plugin/loader.hpp"
#include "sharding/engine.hpp"

namespace meshrun::test::engine_paths {

using sharding::Engine;
using sharding::EngineOptions;
using strategies::Device;
using strategies::DeviceEvent;
using strategies::Dtype;
using strategies::EventRef;

inline constexpr int32_t kUnits = 4;
inline constexpr int32_t kRoot = 3;
inline const std::vector<int32_t> kLayers = {0, 1, 2};
inline const std::vector<Parameter> kParameters = {
    {"model.embed_tokens.weight", 6, 5, kRoot},   {"model.layers.0.q_proj.weight", 5, 3, 0},
    {"model.layers.0.norm.weight", 1, 3, 0},      {"model.layers.1.up_proj.weight", 7, 2, 1},
    {"model.layers.2.down_proj.weight", 2, 7, 2}, {"lm_head.weight", 6, 5, kRoot},
};

// The options both devices run with, and what the ordered one counted.
struct Ledger {
  EngineOptions options;
  int64_t events = 0;         // recorded on the "comm stream"
  int64_t compute_waits = 0;  // on one of them
};
inline Ledger ledger;

inline EngineOptions parse_options(const char*) { return ledger.options; }

class Marker final : public DeviceEvent {};

class OrderedHostDevice final : public Device {
 public:
  DLDevice where() const override { return host_->where(); }
  bool orders_work_after_collectives() const override { return true; }
  std::byte* allocate(size_t bytes) override { return host_->allocate(bytes); }
  void free(std::byte* data) override { host_->free(data); }
  void zero_for_compute(std::byte* data, size_t bytes, const DeviceEvent* last_use) override {
    host_->zero_for_compute(data, bytes, last_use);
  }
  void copy(float* to, const float* from, int64_t count) override { host_->copy(to, from, count); }
  void narrow(Dtype dtype, const float* in, void* out, int64_t count, float scale) override {
    host_->narrow(dtype, in, out, count, scale);
  }
  void widen(Dtype dtype, const void* in, float* out, int64_t count) override {
    host_->widen(dtype, in, out, count);
  }
  void widen_add(Dtype dtype, const void* in, float* out, int64_t count) override {
    host_->widen_add(dtype, in, out, count);
  }
  strategies::NonFinite first_non_finite(const float* data, int64_t count) override {
    return host_->first_non_finite(data, count);
  }
  void comm_follows_compute() override {}
  void compute_follows_comm() override {}
  EventRef record() override {
    ++ledger.events;
    return std::make_shared<const Marker>();
  }
  void compute_waits(const DeviceEvent* event) override {
    if (event != nullptr) ++ledger.compute_waits;
  }

 private:
  std::unique_ptr<Device> host_ = strategies::make_host_device();
};

inline std::unique_ptr<Device> make_ordered(const meshrun_strategy_setup&) {
  return std::make_unique<OrderedHostDevice>();
}

inline float initial_weight(int64_t i) { return 0.29f * float(i % 17) - 2.1f + 0.0093f * float(i); }

// Data-parallel rank `rank`'s gradient of element i of a unit.
inline float local_gradient(int64_t rank, int step, int m, int64_t i) {
  return 0.4f + 0.0171f * float((m + 1) * (step + 2) + rank) + 0.0037f * float(i % 13);
}

using Trace = std::vector<std::vector<float>>;

inline std::vector<float> read(const DLTensor& view, size_t element_bytes) {
  const size_t bytes = size_t(view.shape[0]) * element_bytes;
  std::vector<float> out((bytes + 3) / 4, 0.0f);
  std::memcpy(out.data(), view.data, bytes);
  return out;
}

// The groups one engine runs over: data-parallel = every rank.
struct Groups {
  Communicator& data_parallel;
  Communicator& shard;
  Communicator& replicate;
  const meshrun_comm_api* comm;  // the table the engine calls
};

// One engine driven as a trainer drives fsdp2: setup from rank 0's weights,
// broadcast_parameters, two steps of two micro-batches (the first deferred),
// the hooks around every unit, the rank's gradients added through the unit
// views, an SGD step on the local shard, then gather_parameters. The trace
// holds every view at every pre_ hook (float32, and bfloat16 when gathered
// so), the local shard's gradients after each step, the gathered parameters.
class Script {
 public:
  Script(sharding::DeviceMaker make_device, const Groups& groups)
      : engine_(meshrun::host_services(), "fsdp2 test", &parse_options, make_device),
        rank_(groups.data_parallel.rank()) {
    offsets_.push_back(0);
    for (const Parameter& p : kParameters) {
      offsets_.push_back(offsets_.back() + p.rows * p.columns);
      names_.push_back(p.name);
      units_.push_back(p.unit);
      rows_.push_back(p.rows);
    }
    numel_ = offsets_.back();
    // Ranks start apart: setup takes rank 0's.
    for (int64_t i = 0; i < numel_; ++i) weights_.push_back(initial_weight(i) + float(rank_));
    gradients_.assign(size_t(numel_), 0.0f);
    meshrun_strategy_setup setup{};
    setup.struct_size = sizeof setup;
    setup.comm = groups.comm;
    setup.data_parallel = groups.data_parallel.handle();
    setup.parameters = flat(weights_.data());
    setup.gradients = flat(gradients_.data());
    setup.num_parameters = int64_t(kParameters.size());
    setup.parameter_offsets = offsets_.data();
    setup.parameter_names = names_.data();
    setup.options_json = "{}";
    setup.shard_group = groups.shard.handle();
    setup.replicate_group = groups.replicate.handle();
    setup.num_units = kUnits;
    setup.root_unit = kRoot;
    setup.parameter_units = units_.data();
    setup.parameter_rows = rows_.data();
    engine_.setup(&setup);
  }

  // With `plant_nan`, the sync micro-batch of the first step writes a NaN
  // into element 3 of unit 1's gradients.
  Trace run(bool plant_nan = false) {
    plant_nan_ = plant_nan;
    engine_.broadcast_parameters();
    for (int step = 0; step < 2; ++step) {
      for (int m = 0; m < 2; ++m) micro_batch(step, m);
      engine_.finish_gradients();
      sgd_step();
    }
    std::vector<float> full(size_t(numel_), 0.0f);
    DLTensor tensor = flat(full.data());
    engine_.gather_parameters(&tensor);
    trace_.push_back(full);
    return trace_;
  }

 private:
  DLTensor flat(float* data) {
    return DLTensor{data, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &numel_, nullptr, 0};
  }

  void micro_batch(int step, int m) {
    engine_.begin_micro_batch(m == 1);
    engine_.pre_forward(kRoot);
    record_views(kRoot);
    for (int32_t u : kLayers) {
      engine_.pre_forward(u);
      record_views(u);
      engine_.post_forward(u);
    }
    engine_.post_forward(kRoot);
    engine_.pre_backward(kRoot);
    add_gradients(kRoot, step, m);
    for (auto u = kLayers.rbegin(); u != kLayers.rend(); ++u) {
      engine_.pre_backward(*u);
      record_views(*u);
      add_gradients(*u, step, m);
      engine_.post_backward(*u);
    }
    engine_.post_backward(kRoot);
  }

  void record_views(int32_t unit) {
    DLTensor parameters{};
    engine_.unit_views(unit, &parameters, nullptr);
    trace_.push_back(read(parameters, sizeof(float)));
    DLTensor bfloat16{};
    engine_.unit_views_bfloat16(unit, &bfloat16);
    if (bfloat16.data != nullptr) trace_.push_back(read(bfloat16, sizeof(uint16_t)));
  }

  void add_gradients(int32_t unit, int step, int m) {
    DLTensor gradients{};
    engine_.unit_views(unit, nullptr, &gradients);
    auto* values = static_cast<float*>(gradients.data);
    for (int64_t i = 0; i < gradients.shape[0]; ++i) {
      values[i] += local_gradient(rank_, step, m, i + unit * 59);
    }
    if (plant_nan_ && unit == 1 && step == 0 && m == 1) values[3] = std::nanf("");
  }

  void sgd_step() {
    DLTensor parameters{};
    DLTensor gradients{};
    engine_.local_shard(&parameters, &gradients);
    auto* p = static_cast<float*>(parameters.data);
    auto* g = static_cast<float*>(gradients.data);
    trace_.push_back(read(gradients, sizeof(float)));
    for (int64_t i = 0; i < parameters.shape[0]; ++i) {
      p[i] -= 0.25f * g[i];
      g[i] = 0.0f;
    }
  }

  Engine engine_;
  int64_t rank_;
  std::vector<int64_t> offsets_;
  std::vector<const char*> names_;
  std::vector<int32_t> units_;
  std::vector<int64_t> rows_;
  int64_t numel_ = 0;
  std::vector<float> weights_;
  std::vector<float> gradients_;
  bool plant_nan_ = false;
  Trace trace_;
};

// The options of each compared case.
struct Case {
  const char* name;
  void (*change)(EngineOptions&);
};

inline const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"float32 gathers and reductions", [](EngineOptions&) {}},
      {"bfloat16 gathers", [](EngineOptions& o) { o.param_dtype = Dtype::bfloat16; }},
      {"bfloat16 gathers and reductions, reduced every micro-batch",
       [](EngineOptions& o) {
         o.param_dtype = Dtype::bfloat16;
         o.reduce_dtype = Dtype::bfloat16;
         o.defer_grad_sync = false;
       }},
      {"units kept gathered after forward",
       [](EngineOptions& o) {
         o.reshard_after_forward = false;
         o.backward_prefetch_depth = 1;
       }},
      {"no prefetch", [](EngineOptions& o) { o.prefetch = false; }},
      {"reduced at the micro-batch's end", [](EngineOptions& o) { o.overlap_grad_reduce = false; }},
      {"averaged by summing pre-scaled gradients",
       [](EngineOptions& o) { o.average_in_collective = false; }},
      {"double buffering, bfloat16 gathers",
       [](EngineOptions& o) {
         o.double_buffer = true;
         o.backward_prefetch_depth = 1;
         o.param_dtype = Dtype::bfloat16;
       }},
      {"double buffering, float32 gathers",
       [](EngineOptions& o) {
         o.double_buffer = true;
         o.backward_prefetch_depth = 1;
       }},
  };
  return all;
}

// The traces of `c` on the host device over `host_groups` and on the
// ordered one over `ordered_groups`; the ledger then counts the ordered run.
inline std::pair<Trace, Trace> compare_case(const Case& c, const Groups& host_groups,
                                            const Groups& ordered_groups) {
  ledger = Ledger{};
  ledger.options.param_dtype = Dtype::float32;
  c.change(ledger.options);
  Trace expected = Script(&strategies::make_device, host_groups).run();
  ledger.compute_waits = 0;
  ledger.events = 0;
  Trace got = Script(&make_ordered, ordered_groups).run();
  return {std::move(expected), std::move(got)};
}

// The first difference of two traces, or "" when equal bit for bit.
inline std::string first_difference(const Trace& expected, const Trace& got) {
  if (expected.size() != got.size()) {
    return std::to_string(got.size()) + " buffers, expected " + std::to_string(expected.size());
  }
  for (size_t b = 0; b < got.size(); ++b) {
    if (got[b].size() != expected[b].size()) return "buffer " + std::to_string(b) + "'s size";
    for (size_t i = 0; i < got[b].size(); ++i) {
      if (std::memcmp(&got[b][i], &expected[b][i], sizeof(float)) == 0) continue;
      return "buffer " + std::to_string(b) + " element " + std::to_string(i) + ": " +
             std::to_string(got[b][i]) + ", expected " + std::to_string(expected[b][i]);
    }
  }
  return "";
}

// Every pre_ hook of every unit waits for its gather: steps x micro-batches
// x units x (forward + backward).
inline constexpr int64_t kExpectedComputeWaits = 2 * 2 * kUnits * 2;

}  // namespace meshrun::test::engine_paths
