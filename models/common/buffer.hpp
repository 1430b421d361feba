// An array in the memory of one compute (common/compute.hpp): what a model's
// activations, gradients and scratch are held in, so that the same layer
// code holds them on the host or on a GPU. It grows and shrinks as
// std::vector does (new elements zero, values kept, capacity never lost by
// shrinking) but has no element access: its values are read and written by
// the compute's calls only, and reach the host through copy_to_host.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <utility>

#include "common/compute.hpp"

namespace meshrun::models {

template <typename Element>
class Buffer {
 public:
  using value_type = Element;

  // Empty, of no compute yet: assigning or swapping gives it one, and
  // growing it before throws std::logic_error (a buffer whose memory was
  // never said is a bug this finds on the host already).
  Buffer() = default;
  // Empty, of `compute`.
  explicit Buffer(Compute& compute) : compute_(&compute) {}
  // `count` zeros in `compute`'s memory.
  explicit Buffer(size_t count, Compute& compute = host_compute()) : compute_(&compute) {
    resize(count);
  }
  ~Buffer() {
    if (compute_ != nullptr) compute_->release(data_);
  }
  // Takes other's storage and compute; other is left empty, of its compute.
  Buffer(Buffer&& other) noexcept
      : compute_(other.compute_),
        data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        capacity_(std::exchange(other.capacity_, 0)) {}
  Buffer& operator=(Buffer&& other) noexcept {
    Buffer taken(std::move(other));
    swap(taken);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  Element* data() { return data_; }
  const Element* data() const { return data_; }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }
  bool empty() const { return size_ == 0; }
  // Throws std::logic_error for a buffer of no compute.
  Compute& compute() const {
    if (compute_ == nullptr) throw std::logic_error("models::Buffer: a buffer of no compute");
    return *compute_;
  }

  // `count` elements: the first min(size(), count) values kept, the rest
  // zero; beyond the capacity, new memory of at least twice the size.
  void resize(size_t count) {
    if (count > capacity_) {
      Buffer grown(compute());
      grown.capacity_ = std::max(count, 2 * size_);
      grown.data_ = static_cast<Element*>(compute_->allocate(bytes(grown.capacity_)));
      compute_->copy_bytes(grown.data_, data_, bytes(size_));
      grown.size_ = size_;
      swap(grown);
    } else if (count > size_) {
      compute_->zero_bytes(data_ + size_, bytes(count - size_));
    }
    size_ = count;
  }
  void swap(Buffer& other) noexcept {
    std::swap(compute_, other.compute_);
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(capacity_, other.capacity_);
  }

 private:
  static int64_t bytes(size_t count) { return int64_t(count * sizeof(Element)); }

  Compute* compute_ = nullptr;
  Element* data_ = nullptr;
  size_t size_ = 0, capacity_ = 0;
};

}  // namespace meshrun::models
