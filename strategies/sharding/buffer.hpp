// Memory fsdp2 allocates during a step (gathered parameters, unit
// gradients, communication buffers), counted as it is held so that
// memory() reports it and its peak.
//
// Released buffers are kept for reuse by the next buffer of the same size,
// as PyTorch's caching allocator does: every step asks for the same sizes,
// and fresh pages from the kernel cost a page fault per 4 KiB, which on a
// CPU run took more time than the collectives themselves. What is kept is
// reported as reserved memory.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>

namespace meshrun::sharding {

using Bytes = std::unique_ptr<std::byte[]>;

// Bytes held now, the most held at once, and the idle buffers kept for reuse.
class MemoryMeter {
 public:
  // `bytes` bytes, zeroed when `zero`: an idle buffer of that size if one is
  // kept, else a new one.
  Bytes take(size_t bytes, bool zero) {
    Bytes data;
    if (const auto kept = idle_.find(bytes); kept != idle_.end()) {
      data = std::move(kept->second);
      idle_.erase(kept);
      idle_bytes_ -= static_cast<int64_t>(bytes);
      if (zero) std::memset(data.get(), 0, bytes);
    } else {
      data = zero ? std::make_unique<std::byte[]>(bytes)
                  : std::make_unique_for_overwrite<std::byte[]>(bytes);
    }
    now_ += static_cast<int64_t>(bytes);
    peak_ = std::max(peak_, now_);
    return data;
  }
  void give_back(Bytes data, size_t bytes) {
    now_ -= static_cast<int64_t>(bytes);
    idle_bytes_ += static_cast<int64_t>(bytes);
    idle_.emplace(bytes, std::move(data));
  }
  int64_t now() const { return now_; }
  int64_t peak() const { return peak_; }
  int64_t reserved() const { return now_ + idle_bytes_; }

 private:
  int64_t now_ = 0;
  int64_t peak_ = 0;
  int64_t idle_bytes_ = 0;
  std::multimap<size_t, Bytes> idle_;
};

// Bytes on the heap, counted by a meter while held. Move-only.
class Buffer {
 public:
  explicit Buffer(MemoryMeter& meter) : meter_(&meter) {}
  Buffer(Buffer&& other) noexcept
      : meter_(other.meter_), data_(std::move(other.data_)), bytes_(other.bytes_) {
    other.bytes_ = 0;
  }
  Buffer& operator=(Buffer&&) = delete;
  Buffer(const Buffer&) = delete;
  ~Buffer() { release(); }

  // Holds `bytes` bytes, zeroed when `zero`, releasing what it held.
  void allocate(size_t bytes, bool zero) {
    release();
    data_ = meter_->take(bytes, zero);
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
  }
  void release() {
    if (!data_) return;
    meter_->give_back(std::move(data_), bytes_);
    bytes_ = 0;
  }
  bool held() const { return data_ != nullptr; }
  std::byte* data() const { return data_.get(); }
  float* floats() const { return reinterpret_cast<float*>(data_.get()); }

 private:
  MemoryMeter* meter_;
  Bytes data_;
  size_t bytes_ = 0;
};

}  // namespace meshrun::sharding
