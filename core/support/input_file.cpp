#include "support/input_file.hpp"

#include <fmt/format.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

namespace meshrun {
namespace {

std::string file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// The limits are whole MiB or GiB.
std::string limit_text(int64_t bytes) {
  constexpr int64_t kGiB = int64_t(1) << 30;
  if (bytes % kGiB == 0) return fmt::format("{} GiB", bytes / kGiB);
  return fmt::format("{} MiB", bytes >> 20);
}

}  // namespace

std::optional<std::string> unreadable_input_file(const std::string& path, int64_t max_bytes) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    return fmt::format("cannot read '{}': {}; expected an existing regular file", path,
                       std::strerror(errno));
  }
  if (!S_ISREG(info.st_mode)) {
    return fmt::format("'{}' is {}; expected a regular file", path, file_type_name(info.st_mode));
  }
  if (info.st_size > max_bytes) {
    return fmt::format(
        "'{}' has {} bytes; expected a regular file of at most {} ({} bytes), which meshrun "
        "reads whole into memory",
        path, int64_t(info.st_size), limit_text(max_bytes), max_bytes);
  }
  return std::nullopt;
}

}  // namespace meshrun
