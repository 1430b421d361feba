// Files a run reads whole into memory (the training data, a pipeline
// schedule CSV). They are checked with stat(2) before anything opens them,
// so that a FIFO, a device or a file larger than memory is an input error
// instead of a hang or an exhausted machine (docs/decisions.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace meshrun {

// data.path: every rank holds the whole file (one byte per token).
inline constexpr int64_t kMaxDataFileBytes = int64_t(4) << 30;
// A schedule CSV: PyTorch's files are kilobytes; this bounds the memory of
// its cells far above any real schedule.
inline constexpr int64_t kMaxScheduleCsvBytes = int64_t(64) << 20;

// Why `path` cannot be read whole: it does not exist (or stat fails), is not
// a regular file (a directory, FIFO, device or socket), or is larger than
// `max_bytes`. nullopt when it can.
std::optional<std::string> unreadable_input_file(const std::string& path, int64_t max_bytes);

}  // namespace meshrun
