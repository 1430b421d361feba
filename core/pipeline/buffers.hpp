// The executor's activation buffers: one per (kind, stage, microbatch),
// allocated when the schedule first needs it and freed once consumed, so
// that what a rank holds follows the schedule's activations in flight.
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace meshrun::pipeline {

// What a buffer holds for its stage: the activation entering it, the one
// leaving it, the gradient arriving for its output, the gradient it
// produces for its input.
enum class BufferKind : int32_t { input, output, grad_output, grad_input };

struct BufferKey {
  BufferKind kind = BufferKind::input;
  int32_t stage = 0;
  int32_t microbatch = 0;
  friend auto operator<=>(const BufferKey&, const BufferKey&) = default;
};

// "output of stage 2, microbatch 5".
std::string describe(const BufferKey& key);

class ActivationBuffers {
 public:
  // A new buffer of `numel` floats under `key`; refused when `key` is held.
  float* allocate(const BufferKey& key, int64_t numel);
  // The buffer under `key`, or null. Its address stays valid until it is
  // released, also across renames.
  float* find(const BufferKey& key);
  // Moves the buffer under `from` to `to` without copying (an activation
  // handed to the next stage on this rank).
  void rename(const BufferKey& from, const BufferKey& to);
  void release(const BufferKey& key);

  int64_t live() const { return static_cast<int64_t>(buffers_.size()); }
  // The most buffers and bytes held at once since the last reset_peak().
  int64_t peak() const { return peak_; }
  int64_t peak_bytes() const { return peak_bytes_; }
  void reset_peak();
  // The keys still held, for the message of a step that left some behind.
  std::vector<BufferKey> keys() const;
  void clear();

 private:
  std::map<BufferKey, std::vector<float>> buffers_;
  int64_t bytes_ = 0;
  int64_t peak_ = 0;
  int64_t peak_bytes_ = 0;
};

}  // namespace meshrun::pipeline
