// The files a run writes (docs/design.md, "Output directory"), written so
// that a full disk or a failing device never goes unnoticed: every write,
// fsync and close is checked, and an error names the file and the bytes that
// did not reach it. Files that replace others (the export, a checkpoint's
// files) go through a temporary name, fsync and rename, so a reader sees the
// old file or the whole new one (docs/checkpoints.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "errors.hpp"

namespace meshrun {

// A file opened for writing (created or truncated) on its descriptor: no
// user-space buffer, so an error surfaces at the write that hit it. Keeps the
// XXH3-64 checksum of the bytes written. `name` is the file the user knows
// (the final name of a temporary file), used in errors.
class OutputFile {
 public:
  OutputFile(std::string path, std::string name);
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();

  // All of `bytes`, or throws MESHRUN_UNAVAILABLE naming the file, the bytes
  // missing and the system's reason. `file_bytes`, when the caller knows the
  // whole file's size, makes "missing" count the rest of the file.
  void write(const void* data, size_t bytes, int64_t file_bytes = -1);
  void write(std::string_view text) { write(text.data(), text.size()); }
  void sync();   // fsync: the bytes are on the device
  void close();  // checked (some file systems report a failed write here)

  int64_t bytes_written() const { return written_; }
  uint64_t checksum() const;

 private:
  Error failure(const std::string& what, int error_number) const;

  std::string path_, name_;
  int fd_ = -1;
  int64_t written_ = 0;
  void* hash_state_ = nullptr;  // XXH3_state_t, kept out of this header
};

// What write_atomically wrote.
struct WrittenFile {
  int64_t bytes = 0;
  uint64_t checksum = 0;  // XXH3-64 of the whole file
};

// Writes `path` through `path.partial`: `fill` writes the bytes, then the
// file is fsynced, renamed over `path`, and its folder fsynced.
WrittenFile write_atomically(const std::string& path, const std::function<void(OutputFile&)>& fill);

// fsync of a folder, so the renames and new names in it are on the device.
void sync_directory(const std::string& dir);

// Writes `text` to `path` (replacing it) through OutputFile: every byte
// and the close are checked, errors name the file.
void write_text_file(const std::string& path, std::string_view text);

// XXH3-64 of a whole file, read in blocks; throws naming the file when it
// cannot be read.
uint64_t file_checksum(const std::string& path);

// A checksum as index.json writes it: 16 lower-case hex digits.
std::string checksum_text(uint64_t checksum);

}  // namespace meshrun
