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

int64_t bytes_of(const std::vector<float>& buffer) {
  return static_cast<int64_t>(buffer.size() * sizeof(float));
}

}  // namespace

std::string describe(const BufferKey& key) {
  return fmt::format("{} of stage {}, microbatch {}", kind_name(key.kind), key.stage,
                     key.microbatch);
}

// A key held twice means the schedule produces the same activation twice
// (two F, two RECV_F, ...): bad input, which the executor names.
float* ActivationBuffers::allocate(const BufferKey& key, int64_t numel) {
  const auto [it, inserted] = buffers_.try_emplace(key, static_cast<size_t>(numel));
  if (!inserted) throw invalid_argument("the " + describe(key) + " is already held");
  bytes_ += bytes_of(it->second);
  peak_ = std::max(peak_, live());
  peak_bytes_ = std::max(peak_bytes_, bytes_);
  return it->second.data();
}

float* ActivationBuffers::find(const BufferKey& key) {
  const auto it = buffers_.find(key);
  return it == buffers_.end() ? nullptr : it->second.data();
}

// Extracting the node keeps the vector, and so the data pointer a pending
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
  bytes_ -= bytes_of(it->second);
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
  bytes_ = 0;
}

}  // namespace meshrun::pipeline
