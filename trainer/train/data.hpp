// The training data: a file's bytes as tokens (vocabulary 256), its last
// data.val_fraction held out for validation (docs/design.md, "Validation loss").
//
// Training sequences are chosen by (seed, step, index in the global batch)
// alone, so the global batch is the same whatever the world size, and a
// resumed run needs no sampler state beyond the step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "state/state_device.hpp"

namespace meshrun::train {

// `ids` copied into `copy` (reallocated when the size differs), memory of
// `device`, where the model stage reads tokens and targets; returns it.
const int32_t* copy_to_state(StateDevice& device, const std::vector<int32_t>& ids,
                             StateArray<int32_t>& copy);

class TokenData {
 public:
  // Reads data.path and checks that it fits data.seq_len; input errors name
  // the key and its position in the config.
  explicit TokenData(const Config& config);

  int64_t seq_len() const { return seq_len_; }
  int64_t train_bytes() const { return train_bytes_; }
  int64_t val_windows() const { return val_windows_; }

  // Where sequence `index` of step `step`'s global batch starts.
  int64_t sample_offset(uint64_t seed, int64_t step, int64_t index) const;

  // Fills tokens and targets ([count, seq_len] each) with sequences
  // first..first+count-1 of step `step`'s global batch.
  void training_batch(uint64_t seed, int64_t step, int64_t first, int64_t count,
                      std::vector<int32_t>& tokens, std::vector<int32_t>& targets) const;
  // The same for validation windows first..first+count-1.
  void validation_batch(int64_t first, int64_t count, std::vector<int32_t>& tokens,
                        std::vector<int32_t>& targets) const;

 private:
  void copy_window(int64_t offset, int64_t row, std::vector<int32_t>& tokens,
                   std::vector<int32_t>& targets) const;

  std::vector<uint8_t> bytes_;
  int64_t seq_len_ = 0;
  int64_t train_bytes_ = 0;  // bytes_[0, train_bytes_) trains; the rest validates
  int64_t val_windows_ = 0;
};

}  // namespace meshrun::train
