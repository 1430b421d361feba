#include "train/data.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "state/input_error.hpp"

namespace meshrun::train {
namespace {

std::vector<uint8_t> read_bytes(const Config& config) {
  const std::string& path = config.data.path;
  const std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) {
    throw config_error(config, "data.path",
                       fmt::format("cannot read '{}': {}", path, std::strerror(errno)));
  }
  std::vector<uint8_t> bytes;
  uint8_t chunk[1 << 16];
  for (size_t n; (n = std::fread(chunk, 1, sizeof chunk, file.get())) > 0;) {
    bytes.insert(bytes.end(), chunk, chunk + n);
  }
  if (std::ferror(file.get())) {
    throw config_error(config, "data.path", fmt::format("cannot read '{}' (a directory?)", path));
  }
  return bytes;
}

// splitmix64's finalizer: a counter-based hash, so any (seed, step, index)
// gives its offset without generating the ones before it.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

TokenData::TokenData(const Config& config)
    : bytes_(read_bytes(config)), seq_len_(config.data.seq_len) {
  const auto total = int64_t(bytes_.size());
  const auto val_bytes = int64_t(double(total) * config.data.val_fraction);
  train_bytes_ = total - val_bytes;
  val_windows_ = val_bytes / (seq_len_ + 1);
  if (seq_len_ + 1 > train_bytes_) {
    throw config_error(config, "data.seq_len",
                       fmt::format("{} + 1 bytes do not fit the training part of '{}' ({} of its "
                                   "{} bytes; data.val_fraction holds out the rest)",
                                   seq_len_, config.data.path, train_bytes_, total));
  }
  if (val_bytes > 0 && val_windows_ == 0) {
    throw config_error(config, "data.val_fraction",
                       fmt::format("the held-out tail of '{}' ({} bytes) is shorter than one "
                                   "validation window of data.seq_len + 1 = {} bytes; raise it "
                                   "or set 0 for no validation",
                                   config.data.path, val_bytes, seq_len_ + 1));
  }
}

int64_t TokenData::sample_offset(uint64_t seed, int64_t step, int64_t index) const {
  const uint64_t hash = mix(mix(mix(seed) ^ uint64_t(step)) ^ uint64_t(index));
  // Every start whose window of seq_len + 1 bytes stays in the training part.
  return int64_t(hash % uint64_t(train_bytes_ - seq_len_));
}

void TokenData::copy_window(int64_t offset, int64_t row, std::vector<int32_t>& tokens,
                            std::vector<int32_t>& targets) const {
  for (int64_t t = 0; t < seq_len_; ++t) {
    tokens[row * seq_len_ + t] = bytes_[offset + t];
    targets[row * seq_len_ + t] = bytes_[offset + t + 1];
  }
}

void TokenData::training_batch(uint64_t seed, int64_t step, int64_t first, int64_t count,
                               std::vector<int32_t>& tokens, std::vector<int32_t>& targets) const {
  tokens.resize(count * seq_len_);
  targets.resize(count * seq_len_);
  for (int64_t row = 0; row < count; ++row) {
    copy_window(sample_offset(seed, step, first + row), row, tokens, targets);
  }
}

void TokenData::validation_batch(int64_t first, int64_t count, std::vector<int32_t>& tokens,
                                 std::vector<int32_t>& targets) const {
  tokens.resize(count * seq_len_);
  targets.resize(count * seq_len_);
  for (int64_t row = 0; row < count; ++row) {
    copy_window(train_bytes_ + (first + row) * (seq_len_ + 1), row, tokens, targets);
  }
}

const int32_t* copy_to_state(StateDevice& device, const std::vector<int32_t>& ids,
                             StateArray<int32_t>& copy) {
  const auto count = int64_t(ids.size());
  if (copy.size() != count) copy = StateArray<int32_t>(count, device);
  device.copy_from_host(copy.data(), ids.data(), count * int64_t(sizeof(int32_t)));
  return copy.data();
}

}  // namespace meshrun::train
