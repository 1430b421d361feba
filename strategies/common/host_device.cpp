// A strategy's buffers in host memory: every call completes before it
// returns, so there is nothing to order.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <string>

#include "common/errors.hpp"
#include "device.hpp"

namespace meshrun::strategies {
namespace {

class HostDevice final : public Device {
 public:
  DLDevice where() const override { return {kDLCPU, 0}; }
  bool orders_work_after_collectives() const override { return false; }

  // Uninitialized, as std::make_unique_for_overwrite: the casts and the
  // collectives write every byte before it is read, and untouched pages
  // cost nothing.
  std::byte* allocate(size_t bytes) override {
    auto* data = new (std::nothrow) std::byte[bytes];
    if (data == nullptr) {
      throw strategies::Error(MESHRUN_UNAVAILABLE,
                              "out of host memory: " + std::to_string(bytes) + " bytes asked for");
    }
    return data;
  }
  void free(std::byte* data) override { delete[] data; }

  void zero_for_compute(std::byte* data, size_t bytes, const DeviceEvent*) override {
    std::memset(data, 0, bytes);
  }
  void copy(float* to, const float* from, int64_t count) override {
    std::memcpy(to, from, static_cast<size_t>(count) * sizeof(float));
  }
  void narrow(Dtype dtype, const float* in, void* out, int64_t count, float scale) override {
    strategies::narrow(dtype, in, out, count, scale);
  }
  void widen(Dtype dtype, const void* in, float* out, int64_t count) override {
    strategies::widen(dtype, in, out, count);
  }
  void widen_add(Dtype dtype, const void* in, float* out, int64_t count) override {
    strategies::widen_add(dtype, in, out, count);
  }
  NonFinite first_non_finite(const float* data, int64_t count) override {
    const float* found =
        std::find_if(data, data + count, [](float value) { return !std::isfinite(value); });
    if (found == data + count) return {};
    return {found - data, *found};
  }

  void comm_follows_compute() override {}
  void compute_follows_comm() override {}
  EventRef record() override { return nullptr; }
  void compute_waits(const DeviceEvent*) override {}
};

}  // namespace

std::unique_ptr<Device> make_host_device() { return std::make_unique<HostDevice>(); }

std::unique_ptr<Device> make_device(const meshrun_strategy_setup& setup) {
  if (setup.comm->device_type != kDLCUDA) return make_host_device();
  const bool streams = MESHRUN_HAS_FIELD(meshrun_strategy_setup, &setup, comm_stream);
  return make_cuda_device(setup.parameters.device.device_id,
                          streams ? setup.compute_stream : nullptr,
                          streams ? setup.comm_stream : nullptr);
}

}  // namespace meshrun::strategies
