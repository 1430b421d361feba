// Memory the sharding engine allocates during a step (gathered parameters,
// unit gradients, communication buffers), on its device, counted as it is
// held so that memory() reports it and its peak.
//
// Released buffers are kept for reuse by the next buffer of the same size,
// as PyTorch's caching allocator does: every step asks for the same sizes,
// and fresh pages from the kernel cost a page fault per 4 KiB, which on a
// CPU run took more time than the collectives themselves (on a GPU,
// cudaMalloc synchronizes the device). What is kept is reported as reserved
// memory.
//
// On a GPU a buffer may be released while the comm stream still uses it
// (a collective in flight): it carries that collective's event, and a reuse
// by the host's compute waits for it (device.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>

#include "common/device.hpp"

namespace meshrun::sharding {

using strategies::Device;
using strategies::DeviceEvent;
using strategies::EventRef;

// Bytes held now, the most held at once, and the idle buffers kept for reuse.
class MemoryMeter {
 public:
  MemoryMeter() = default;
  MemoryMeter(const MemoryMeter&) = delete;
  MemoryMeter& operator=(const MemoryMeter&) = delete;
  ~MemoryMeter() {
    for (auto& [bytes, kept] : idle_) device_->free(kept.data);
  }

  // The device allocations come from; before the first take.
  void use(Device& device) { device_ = &device; }
  Device& device() const { return *device_; }

  // `bytes` bytes: an idle buffer of that size if one is kept, else a new
  // one. Zeroed for the host's compute when `zero_for_compute`; otherwise
  // for the comm stream, which orders itself after the buffer's last use.
  std::byte* take(size_t bytes, bool zero_for_compute) {
    Kept kept;
    if (const auto found = idle_.find(bytes); found != idle_.end()) {
      kept = std::move(found->second);
      idle_.erase(found);
      idle_bytes_ -= static_cast<int64_t>(bytes);
    } else {
      kept.data = device_->allocate(bytes);
    }
    if (zero_for_compute) device_->zero_for_compute(kept.data, bytes, kept.last_use.get());
    now_ += static_cast<int64_t>(bytes);
    peak_ = std::max(peak_, now_);
    return kept.data;
  }
  // Takes back `data` (`bytes` bytes), whose comm work ends at `last_use`.
  void give_back(std::byte* data, size_t bytes, EventRef last_use) {
    now_ -= static_cast<int64_t>(bytes);
    idle_bytes_ += static_cast<int64_t>(bytes);
    idle_.emplace(bytes, Kept{data, std::move(last_use)});
  }
  int64_t now() const { return now_; }
  int64_t peak() const { return peak_; }
  int64_t reserved() const { return now_ + idle_bytes_; }

 private:
  struct Kept {
    std::byte* data = nullptr;
    EventRef last_use;
  };

  Device* device_ = nullptr;
  int64_t now_ = 0;
  int64_t peak_ = 0;
  int64_t idle_bytes_ = 0;
  std::multimap<size_t, Kept> idle_;
};

// Bytes on the meter's device, counted by the meter while held. Move-only.
class Buffer {
 public:
  explicit Buffer(MemoryMeter& meter) : meter_(&meter) {}
  Buffer(Buffer&& other) noexcept
      : meter_(other.meter_),
        data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        last_use_(std::move(other.last_use_)) {}
  Buffer& operator=(Buffer&&) = delete;
  Buffer(const Buffer&) = delete;
  ~Buffer() { release(); }

  // Holds `bytes` bytes, zeroed for the host's compute when
  // `zero_for_compute`, releasing what it held.
  void allocate(size_t bytes, bool zero_for_compute) {
    release();
    data_ = meter_->take(bytes, zero_for_compute);
    bytes_ = bytes;
  }
  // Holds at least `bytes` bytes: what it holds when that is enough (its
  // contents left as they are), else `bytes` new ones.
  void ensure(size_t bytes) {
    if (held() && bytes_ >= bytes) return;
    allocate(bytes, false);
  }
  void swap(Buffer& other) noexcept {
    std::swap(meter_, other.meter_);
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    std::swap(last_use_, other.last_use_);
  }
  // The comm work enqueued so far that uses the buffer ends at `event`.
  void used_until(EventRef event) { last_use_ = std::move(event); }
  void release() {
    if (data_ == nullptr) return;
    meter_->give_back(std::exchange(data_, nullptr), bytes_, std::move(last_use_));
    last_use_ = nullptr;
    bytes_ = 0;
  }
  bool held() const { return data_ != nullptr; }
  std::byte* data() const { return data_; }
  float* floats() const { return reinterpret_cast<float*>(data_); }

 private:
  MemoryMeter* meter_;
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  EventRef last_use_;
};

}  // namespace meshrun::sharding
