#include "pipeline/buffers.hpp"

#include <fmt/format.h>
#include <algorithm>

#include "errors.hpp"

namespace meshrun::pipeline {
namespace {

const char* kind_name(BufferKind kind) {
  switch (kind) {
    case BufferKind::input:
      return "input";
    case BufferKind::output:
      return "output";
    case BufferKind::grad_output:
      return "output gradient";
    case BufferKind::grad_input:
      return "input gradient";
  }
  return "buffer";
}

int64_t bytes_of(const StateArray<float>& buffer) { return buffer.size() * int64_t(sizeof(float)); }

}  // namespace

std::string describe(const BufferKey& key) {
  return fmt::format("{} of stage {}, microbatch {}", kind_name(key.kind), key.stage,
                     key.microbatch);
}

// A key held twice means the schedule produces the same activation twice
// (two F, two RECV_F, ...): bad input, which the executor names.
float* ActivationBuffers::hold(const BufferKey& key, Held held) {
  if (buffers_.contains(key)) throw invalid_argument("the " + describe(key) + " is already held");
  const auto it = buffers_.emplace(key, std::move(held)).first;
  bytes_ += bytes_of(it->second.values);
  peak_ = std::max(peak_, live());
  peak_bytes_ = std::max(peak_bytes_, bytes_);
  return it->second.values.data();
}

float* ActivationBuffers::allocate(const BufferKey& key, int64_t numel) {
  ++allocations_;
  return hold(key, {StateArray<float>(numel, device_), false});
}

float* ActivationBuffers::receive(const BufferKey& key, int64_t numel) {
  const auto pooled = std::find_if(pool_.begin(), pool_.end(),
                                   [&](const StateArray<float>& v) { return v.size() == numel; });
  Held held{{}, true};
  if (pooled != pool_.end()) {
    held.values = std::move(*pooled);
    pool_.erase(pooled);
    pooled_bytes_ -= bytes_of(held.values);
  } else {
    ++allocations_;
    held.values = StateArray<float>(numel, device_);
  }
  float* data = hold(key, std::move(held));
  receive_depth_ = std::max(receive_depth_, ++received_held_);
  return data;
}

float* ActivationBuffers::find(const BufferKey& key) {
  const auto it = buffers_.find(key);
  return it == buffers_.end() ? nullptr : it->second.values.data();
}

// Extracting the node keeps the array, and so the data pointer a pending
// transfer may hold, where it is.
void ActivationBuffers::rename(const BufferKey& from, const BufferKey& to) {
  if (buffers_.contains(to)) throw invalid_argument("the " + describe(to) + " is already held");
  auto node = buffers_.extract(from);
  if (node.empty()) throw invalid_argument("no " + describe(from) + " to hand over");
  node.key() = to;
  buffers_.insert(std::move(node));
}

void ActivationBuffers::release(const BufferKey& key) {
  const auto it = buffers_.find(key);
  if (it == buffers_.end()) return;
  Held& held = it->second;
  bytes_ -= bytes_of(held.values);
  if (held.received) --received_held_;
  if (held.received && pool_received_ && static_cast<int64_t>(pool_.size()) < receive_depth_) {
    pooled_bytes_ += bytes_of(held.values);
    pool_.push_back(std::move(held.values));
  }
  buffers_.erase(it);
}

void ActivationBuffers::reset_peak() {
  peak_ = live();
  peak_bytes_ = bytes_;
}

std::vector<BufferKey> ActivationBuffers::keys() const {
  std::vector<BufferKey> held;
  for (const auto& [key, buffer] : buffers_) held.push_back(key);
  return held;
}

void ActivationBuffers::clear() {
  buffers_.clear();
  received_held_ = 0;
  bytes_ = 0;
}

}  // namespace meshrun::pipeline
