// The optimizer and the core's step arithmetic reach a rank's state only
// through its state device (state/state_device.hpp), as they must on a GPU:
// a device whose memory faults outside its calls (the fenced memory of
// fenced_compute.hpp) runs AdamW, clipping, the finiteness check, rounding
// and a sharded checkpoint's state copies, and must give the host device's
// results bit for bit (the same loops run inside its calls).
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "fenced_compute.hpp"
#include "state/local_parameters.hpp"
#include "state/optimizer.hpp"
#include "state/state_device.hpp"

namespace {

using meshrun::StateArray;
using meshrun::StateDevice;

// The host's state device on fenced memory: every pointer a call gets
// must be of its allocations (std::logic_error naming the call otherwise),
// and the memory is open only during the call.
class FencedStateDevice : public StateDevice {
 public:
  DLDevice where() const override { return DLDevice{kDLCUDA, 0}; }
  void* stream() const override { return nullptr; }
  void* allocate(int64_t bytes) override { return memory_.allocate(bytes); }
  void release(void* memory) noexcept override { memory_.release(memory); }
  void copy_from_host(void* to, const void* from, int64_t bytes) override {
    inside("copy_from_host", {to}, [&] { host().copy_from_host(to, from, bytes); });
  }
  void copy_to_host(void* to, const void* from, int64_t bytes) override {
    inside("copy_to_host", {from}, [&] { host().copy_to_host(to, from, bytes); });
  }
  void zero(float* values, int64_t count) override {
    inside("zero", {values}, [&] { host().zero(values, count); });
  }
  void scale(float* values, int64_t count, float factor) override {
    inside("scale", {values}, [&] { host().scale(values, count, factor); });
  }
  double squared_norm(const float* values, int64_t count) override {
    double norm = 0;
    inside("squared_norm", {values}, [&] { norm = host().squared_norm(values, count); });
    return norm;
  }
  bool all_finite(const float* values, int64_t count) override {
    bool finite = true;
    inside("all_finite", {values}, [&] { finite = host().all_finite(values, count); });
    return finite;
  }
  void round_to(float* values, int64_t count, const std::string& dtype) override {
    inside("round_to", {values}, [&] { host().round_to(values, count, dtype); });
  }
  void adamw(float* parameters, float* exp_avg, float* exp_avg_sq, const float* gradients,
             const uint8_t* decay, int64_t count,
             const meshrun::AdamWConstants& constants) override {
    inside("adamw", {parameters, exp_avg, exp_avg_sq, gradients, decay}, [&] {
      host().adamw(parameters, exp_avg, exp_avg_sq, gradients, decay, count, constants);
    });
  }

  int64_t calls() const { return calls_; }

 private:
  static StateDevice& host() { return meshrun::host_state_device(); }
  template <class Call>
  void inside(const char* name, std::initializer_list<const void*> pointers, Call&& call) {
    memory_.require_held("state device", name, calls_, pointers);
    ++calls_;
    memory_.opened(call);
  }

  fenced::FencedMemory memory_;
  int64_t calls_ = 0;
};

std::vector<float> values(size_t count, float from) {
  std::vector<float> made(count);
  for (size_t i = 0; i < count; ++i) made[i] = from + 0.37f * float(i % 11) - 0.05f * float(i);
  return made;
}

// The state of one shard: parameters, gradients and their optimizer, on
// `device`, after two clipped steps, rounded to bfloat16.
struct Shard {
  Shard(StateDevice& device, const std::vector<uint8_t>& decay)
      : device(device),
        params(int64_t(decay.size()), device),
        grads(int64_t(decay.size()), device),
        optimizer(train(), decay, device) {
    local.params = params.data();
    local.grads = grads.data();
    local.numel = int64_t(decay.size());
    local.held = {{0, 0, 3}, {3, 3, local.numel - 3}};
    local.held_parameter = {0, 1};
  }
  static meshrun::TrainConfig train() {
    meshrun::TrainConfig config;
    config.weight_decay = 0.1;
    return config;
  }
  void set(float* on_device, const std::vector<float>& host) {
    device.copy_from_host(on_device, host.data(), int64_t(host.size() * sizeof(float)));
  }
  void two_steps() {
    set(local.params, values(size_t(local.numel), 1.0f));
    for (int step = 0; step < 2; ++step) {
      device.zero(local.grads, local.numel);
      set(local.grads, values(size_t(local.numel), float(step) - 2.0f));
      const double norm = std::sqrt(device.squared_norm(local.grads, local.numel));
      meshrun::clip_gradients(device, local.grads, local.numel, norm, 1.0);
      optimizer.step(local.params, local.grads, 1e-2);
      device.round_to(local.params, local.numel, "bfloat16");
    }
  }

  StateDevice& device;
  StateArray<float> params, grads;
  meshrun::AdamW optimizer;
  meshrun::LocalParameters local;
};

}  // namespace

TEST_CASE(
    "state device: the optimizer and the step's arithmetic touch the state through the "
    "device only",
    "[train][device]") {
  const std::vector<uint8_t> decay = {1, 0, 1, 1, 0, 1, 1, 1, 0, 1};
  Shard host(meshrun::host_state_device(), decay);
  FencedStateDevice fenced_device;
  Shard fenced(fenced_device, decay);
  host.two_steps();
  fenced.two_steps();

  const auto state = [](Shard& shard) {
    return meshrun::concatenated_state({{&shard.local, &shard.optimizer}});
  };
  const std::vector<std::vector<float>> expected = state(host);
  CHECK(state(fenced) == expected);
  CHECK(fenced_device.calls() > 10);

  const std::vector<int64_t> description_index = {4, 1};
  CHECK_FALSE(meshrun::first_nonfinite_gradient(fenced_device, fenced.local, description_index));
  fenced.set(fenced.local.grads + 5, {std::numeric_limits<float>::infinity()});
  CHECK(meshrun::first_nonfinite_gradient(fenced_device, fenced.local, description_index) == 1);

  std::vector<std::vector<float>> restored = expected;
  for (auto& part : restored) part[2] += 1.0f;
  meshrun::scatter_state(restored, {{&fenced.local, &fenced.optimizer}});
  CHECK(state(fenced) == restored);
}

TEST_CASE("state device: a host view reads in place on the host and copies a device's memory",
          "[train][device]") {
  std::vector<float> host = values(7, 1.0f);
  meshrun::HostView in_place(meshrun::host_state_device(), host.data(), 7);
  CHECK(in_place.data() == host.data());

  FencedStateDevice device;
  StateArray<float> on_device(7, device);
  device.copy_from_host(on_device.data(), host.data(), 7 * int64_t(sizeof(float)));
  meshrun::HostView view(device, on_device.data(), 7);
  REQUIRE(view.data() != on_device.data());
  CHECK(std::vector<float>(view.data(), view.data() + 7) == host);
  view.data()[3] = 42.0f;
  view.write_back();
  std::vector<float> back(7);
  device.copy_to_host(back.data(), on_device.data(), 7 * int64_t(sizeof(float)));
  host[3] = 42.0f;
  CHECK(back == host);
}
