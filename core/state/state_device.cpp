#include "state/state_device.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <stdexcept>

#include <fmt/format.h>

#include "state/local_parameters.hpp"
#include "state/optimizer.hpp"

namespace meshrun {

namespace {

class HostStateDevice : public StateDevice {
 public:
  DLDevice where() const override { return DLDevice{kDLCPU, 0}; }
  void* stream() const override { return nullptr; }
  void* allocate(int64_t bytes) override {
    if (bytes == 0) return nullptr;
    try {
      return new std::byte[size_t(bytes)]();
    } catch (const std::bad_alloc&) {
      throw std::runtime_error(fmt::format(
          "out of memory: the host's memory (cpu) cannot give the {} bytes asked for", bytes));
    }
  }
  void release(void* memory) noexcept override { delete[] static_cast<std::byte*>(memory); }
  void copy_from_host(void* to, const void* from, int64_t bytes) override {
    if (bytes > 0) std::memmove(to, from, size_t(bytes));
  }
  void copy_to_host(void* to, const void* from, int64_t bytes) override {
    if (bytes > 0) std::memmove(to, from, size_t(bytes));
  }
  void zero(float* values, int64_t count) override { std::fill_n(values, count, 0.0f); }
  void scale(float* values, int64_t count, float factor) override {
    for (int64_t i = 0; i < count; ++i) values[i] *= factor;
  }
  double squared_norm(const float* values, int64_t count) override {
    return meshrun::squared_norm(values, count);
  }
  bool all_finite(const float* values, int64_t count) override {
    return std::all_of(values, values + count, [](float v) { return std::isfinite(v); });
  }
  void round_to(float* values, int64_t count, const std::string& dtype) override {
    meshrun::round_to(values, count, dtype);
  }
  void adamw(float* parameters, float* exp_avg, float* exp_avg_sq, const float* gradients,
             const uint8_t* decay, int64_t count, const AdamWConstants& constants) override {
    adamw_update_all(parameters, exp_avg, exp_avg_sq, gradients, decay, count, constants);
  }
};

}  // namespace

StateDevice& host_state_device() {
  static HostStateDevice device;
  return device;
}

HostView::HostView(StateDevice& device, float* values, int64_t count)
    : device_(device), values_(values), count_(count), data_(values) {
  if (device.where().device_type == kDLCPU) return;
  copy_.resize(size_t(count));
  device.copy_to_host(copy_.data(), values, count * int64_t(sizeof(float)));
  data_ = copy_.data();
}

void HostView::write_back() {
  if (data_ == values_) return;
  device_.copy_from_host(values_, copy_.data(), count_ * int64_t(sizeof(float)));
}

}  // namespace meshrun
