#include "common/kept_activations.hpp"

#include "common/support.hpp"

namespace meshrun::models {

namespace {

// `buffer` holding `size` elements. A buffer whose size changes (a
// mixture's experts', sized by each forward's routing) is allocated anew,
// so it holds what this forward routed, not the most any forward did.
template <typename Element>
void size_exactly(Buffer<Element>& buffer, size_t size, Compute& compute) {
  if (buffer.size() != size) buffer = Buffer<Element>(size, compute);
}

}  // namespace

KeptInBfloat16::KeptInBfloat16(std::vector<size_t> sizes, Compute& compute)
    : compute_(compute), working_(sizes.size()), sizes_(std::move(sizes)) {}

void KeptInBfloat16::lend(const LowPrecisionBuffers& buffers) {
  for (size_t k = 0; k < buffers.size(); ++k) {
    if (buffers[k] == nullptr) continue;
    buffers[k]->swap(working_[k]);
    size_exactly(*buffers[k], sizes_[k], compute_);
  }
}

void KeptInBfloat16::keep(const LowPrecisionBuffers& buffers, BfloatCopies& copies) {
  copies.resize(buffers.size());
  for (size_t k = 0; k < buffers.size(); ++k) {
    if (buffers[k] == nullptr) continue;
    const Buffer<float>& values = *buffers[k];
    size_exactly(copies[k], values.size(), compute_);
    compute_.to_bfloat16(copies[k].data(), values.data(), int64_t(values.size()));
  }
  take_back(buffers);
}

void KeptInBfloat16::restore(const LowPrecisionBuffers& buffers, const BfloatCopies& copies) {
  for (size_t k = 0; k < buffers.size(); ++k) {
    if (buffers[k] == nullptr) continue;
    buffers[k]->swap(working_[k]);
    size_exactly(*buffers[k], copies[k].size(), compute_);
    compute_.from_bfloat16(buffers[k]->data(), copies[k].data(), int64_t(copies[k].size()));
  }
}

void KeptInBfloat16::take_back(const LowPrecisionBuffers& buffers) {
  for (size_t k = 0; k < buffers.size(); ++k) {
    if (buffers[k] != nullptr) working_[k].swap(*buffers[k]);
  }
  release(buffers);
}

void release(const LowPrecisionBuffers& buffers) {
  for (Buffer<float>* buffer : buffers) {
    if (buffer != nullptr) *buffer = Buffer<float>(buffer->compute());
  }
}

void round_to_bfloat16(const LowPrecisionBuffers& buffers) {
  for (Buffer<float>* buffer : buffers) {
    if (buffer != nullptr) {
      buffer->compute().round_to_bfloat16(buffer->data(), int64_t(buffer->size()));
    }
  }
}

void round_kept(bool bfloat16, Buffer<float>& buffer, Compute& compute) {
  if (bfloat16) compute.round_to_bfloat16(buffer.data(), int64_t(buffer.size()));
}

int64_t bytes_of_copies(const BfloatCopies& copies) {
  int64_t total = 0;
  for (const auto& copy : copies) total += bytes_of(copy);
  return total;
}

}  // namespace meshrun::models
