// Memory fsdp2 allocates during a step (gathered parameters, unit
// gradients, communication buffers), counted as it is held so that
// memory() reports it and its peak. A released buffer goes back to the
// allocator at once: the process's peak RSS follows what is held.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace meshrun::fsdp2 {

// Bytes held now, and the most held at once.
class MemoryMeter {
 public:
  void add(int64_t bytes) {
    now_ += bytes;
    peak_ = std::max(peak_, now_);
  }
  void remove(int64_t bytes) { now_ -= bytes; }
  int64_t now() const { return now_; }
  int64_t peak() const { return peak_; }

 private:
  int64_t now_ = 0;
  int64_t peak_ = 0;
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

  // Holds `bytes` new bytes, zeroed when `zero`, releasing what it held.
  void allocate(size_t bytes, bool zero) {
    release();
    data_ = zero ? std::make_unique<std::byte[]>(bytes)
                 : std::make_unique_for_overwrite<std::byte[]>(bytes);
    bytes_ = static_cast<int64_t>(bytes);
    meter_->add(bytes_);
  }
  void release() {
    if (!data_) return;
    data_.reset();
    meter_->remove(bytes_);
    bytes_ = 0;
  }
  bool held() const { return data_ != nullptr; }
  std::byte* data() const { return data_.get(); }
  float* floats() const { return reinterpret_cast<float*>(data_.get()); }

 private:
  MemoryMeter* meter_;
  std::unique_ptr<std::byte[]> data_;
  int64_t bytes_ = 0;
};

}  // namespace meshrun::fsdp2
