// The sharding engine's GPU code paths, run on host memory. On a CUDA device
// the engine enqueues a gather's unpacking and a reduction's add into the
// local shard when the collective starts, keeps gathers' requests until
// they complete, and makes the compute stream wait for a unit's gather
// before the unit computes (strategies/common/device.hpp). Here a device
// that says it orders work after collectives, as a stream does, but computes
// at once, drives those paths over the loopback test comm (one rank; each
// collective is done when its call returns, so every result is there when
// the device reads it). Every view, the local shard's gradients after each
// step and the gathered parameters must equal the host device's bit for bit
// (the same kernels on the same numbers in the same order), for float32
// and bfloat16 gathers, float32 and bfloat16 reductions, deferred and
// immediate reduction, kept-gathered units and no prefetch; the compute
// stream must have waited for every gather it used; a non-finite gradient
// must be reported alike.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "common/device.hpp"
#include "common/errors.hpp"
#include "errors.hpp"
#include "fsdp2_setup.hpp"
#include "plugin/loader.hpp"
#include "sharding/engine.hpp"

namespace {

using meshrun::Communicator;
using meshrun::sharding::Engine;
using meshrun::sharding::EngineOptions;
using meshrun::strategies::Device;
using meshrun::strategies::DeviceEvent;
using meshrun::strategies::Dtype;
using meshrun::strategies::EventRef;
using meshrun::test::Parameter;

constexpr int32_t kUnits = 4;
constexpr int32_t kRoot = 3;
const std::vector<int32_t> kLayers = {0, 1, 2};
const std::vector<Parameter> kParameters = {
    {"model.embed_tokens.weight", 6, 5, kRoot},   {"model.layers.0.q_proj.weight", 5, 3, 0},
    {"model.layers.0.norm.weight", 1, 3, 0},      {"model.layers.1.up_proj.weight", 7, 2, 1},
    {"model.layers.2.down_proj.weight", 2, 7, 2}, {"lm_head.weight", 6, 5, kRoot},
};

// What the two devices are compared on, and what the ordered one counted.
struct Ledger {
  EngineOptions options;
  int64_t events = 0;         // recorded on the "comm stream"
  int64_t compute_waits = 0;  // on one of them
};
Ledger ledger;

EngineOptions parse_options(const char*) { return ledger.options; }

class Marker final : public DeviceEvent {};

// The host device, saying that it orders work after collectives.
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
  meshrun::strategies::NonFinite first_non_finite(const float* data, int64_t count) override {
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
  std::unique_ptr<Device> host_ = meshrun::strategies::make_host_device();
};

std::unique_ptr<Device> make_ordered(const meshrun_strategy_setup&) {
  return std::make_unique<OrderedHostDevice>();
}

float initial_weight(int64_t i) { return 0.29f * float(i % 17) - 2.1f + 0.0093f * float(i); }

float local_gradient(int step, int m, int64_t i) {
  return 0.4f + 0.0171f * float((m + 1) * (step + 2)) + 0.0037f * float(i % 13);
}

using Trace = std::vector<std::vector<float>>;

std::vector<float> read(const DLTensor& view, size_t element_bytes) {
  const size_t bytes = size_t(view.shape[0]) * element_bytes;
  std::vector<float> out((bytes + 3) / 4, 0.0f);
  std::memcpy(out.data(), view.data, bytes);
  return out;
}

// One engine over the loopback comm, driven as a trainer drives fsdp2.
class Script {
 public:
  Script(meshrun::sharding::DeviceMaker make_device, Communicator& world, Communicator& solo)
      : engine_(meshrun::host_services(), "fsdp2 test", &parse_options, make_device) {
    offsets_.push_back(0);
    for (const Parameter& p : kParameters) {
      offsets_.push_back(offsets_.back() + p.rows * p.columns);
      names_.push_back(p.name);
      units_.push_back(p.unit);
      rows_.push_back(p.rows);
    }
    numel_ = offsets_.back();
    weights_.resize(size_t(numel_));
    for (int64_t i = 0; i < numel_; ++i) weights_[size_t(i)] = initial_weight(i);
    gradients_.assign(size_t(numel_), 0.0f);
    meshrun_strategy_setup setup{};
    setup.struct_size = sizeof setup;
    setup.comm = &world.comm_api();
    setup.data_parallel = world.handle();
    setup.parameters = flat(weights_.data());
    setup.gradients = flat(gradients_.data());
    setup.num_parameters = int64_t(kParameters.size());
    setup.parameter_offsets = offsets_.data();
    setup.parameter_names = names_.data();
    setup.options_json = "{}";
    setup.shard_group = world.handle();
    setup.replicate_group = solo.handle();
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
      values[i] += local_gradient(step, m, i + unit * 59);
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

struct Loopback {
  Loopback()
      : loader({MESHRUN_TEST_PLUGIN_DIR}),
        backend(loader.load(meshrun::PluginKind::comm, "loopback")),
        world(backend.world(60.0)),
        solo(world.split(0, 0, "dp_replicate")) {}
  meshrun::PluginLoader loader;
  meshrun::CommBackend backend;
  Communicator world;
  Communicator solo;
};

}  // namespace

TEST_CASE("sharding engine: the GPU's code paths on host memory give the host's bits",
          "[fsdp2][device]") {
  Loopback comm;
  struct Case {
    const char* name;
    void (*change)(EngineOptions&);
  };
  const std::vector<Case> cases = {
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
  };
  for (const Case& c : cases) {
    SECTION(c.name) {
      ledger = Ledger{};
      ledger.options.param_dtype = Dtype::float32;
      c.change(ledger.options);
      const Trace expected = Script(&meshrun::strategies::make_device, comm.world, comm.solo).run();
      ledger.compute_waits = 0;
      const Trace got = Script(&make_ordered, comm.world, comm.solo).run();
      REQUIRE(got.size() == expected.size());
      for (size_t b = 0; b < got.size(); ++b) {
        INFO("buffer " << b);
        REQUIRE(got[b].size() == expected[b].size());
        CHECK(std::memcmp(got[b].data(), expected[b].data(), got[b].size() * sizeof(float)) == 0);
      }
      // Every pre_ hook of a unit holding parameters waited for its gather:
      // 2 steps x 2 micro-batches x 4 units x (forward + backward).
      CHECK(ledger.compute_waits == 2 * 2 * kUnits * 2);
      CHECK(ledger.events > 0);
    }
  }
}

TEST_CASE("sharding engine: a non-finite gradient is reported alike on the GPU's code paths",
          "[fsdp2][device]") {
  Loopback comm;
  std::vector<std::string> messages;
  for (const auto make : {&meshrun::strategies::make_device, &make_ordered}) {
    ledger = Ledger{};
    ledger.options.param_dtype = Dtype::float32;
    ledger.options.report_nan_in_param_grad = true;
    try {
      Script(make, comm.world, comm.solo).run(true);
      messages.emplace_back("no error");
    } catch (const meshrun::strategies::Error& e) {
      CHECK(e.code() == MESHRUN_FAILED_PRECONDITION);
      messages.emplace_back(e.what());
    }
  }
  CHECK_THAT(messages[0], Catch::Contains("'model.layers.1.up_proj.weight' holds nan (element 3)"));
  CHECK(messages[1] == messages[0]);
}
