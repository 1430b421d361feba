// The executor's activation buffers: one per (kind, stage, microbatch),
// allocated when the schedule first needs it and freed once consumed, so
// that what a rank holds follows the schedule's activations in flight.
// With distributed.pipeline.pp_recv_buffer_pool the buffers received from
// other ranks are pooled instead: a released one is kept, up to the most
// received buffers held at once so far (the schedule's receive depth), and
// a later receive of its size takes it back without allocating or zeroing.
// The buffers are memory of a state device (state/state_device.hpp): the
// host's, or the rank's GPU's in a CUDA run, where a release is ordered
// after the work already enqueued on the device's stream.
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "state/state_device.hpp"

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
  explicit ActivationBuffers(bool pool_received = false, StateDevice& device = host_state_device())
      : pool_received_(pool_received), device_(device) {}

  // The memory the buffers are of.
  StateDevice& device() const { return device_; }

  // A new buffer of `numel` zeroed floats under `key`; refused when `key`
  // is held.
  float* allocate(const BufferKey& key, int64_t numel);
  // A buffer of `numel` floats under `key` for a receive to fill: from the
  // pool when it holds one of that size (its old values left), else new.
  float* receive(const BufferKey& key, int64_t numel);
  // The buffer under `key`, or null. Its address stays valid until it is
  // released, also across renames.
  float* find(const BufferKey& key);
  // Moves the buffer under `from` to `to` without copying (an activation
  // handed to the next stage on this rank).
  void rename(const BufferKey& from, const BufferKey& to);
  // Frees the buffer under `key`, or pools it (a received one, with a pool
  // not yet at the receive depth).
  void release(const BufferKey& key);

  int64_t live() const { return static_cast<int64_t>(buffers_.size()); }
  // Bytes the pool keeps for reuse, and the buffers allocated since
  // construction.
  int64_t pooled_bytes() const { return pooled_bytes_; }
  int64_t allocations() const { return allocations_; }
  // The most buffers and bytes held at once since the last reset_peak().
  int64_t peak() const { return peak_; }
  int64_t peak_bytes() const { return peak_bytes_; }
  void reset_peak();
  // The keys still held, for the message of a step that left some behind.
  std::vector<BufferKey> keys() const;
  // Drops every held buffer (after a failed step); the pool stays.
  void clear();

 private:
  struct Held {
    StateArray<float> values;
    bool received = false;
  };
  float* hold(const BufferKey& key, Held held);

  bool pool_received_;
  StateDevice& device_;
  std::map<BufferKey, Held> buffers_;
  std::vector<StateArray<float>> pool_;
  int64_t received_held_ = 0;  // received buffers held now
  int64_t receive_depth_ = 0;  // the most held at once so far
  int64_t pooled_bytes_ = 0;
  int64_t allocations_ = 0;
  int64_t bytes_ = 0;
  int64_t peak_ = 0;
  int64_t peak_bytes_ = 0;
};

}  // namespace meshrun::pipeline
