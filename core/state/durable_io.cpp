#include "state/durable_io.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

namespace meshrun {
namespace {

XXH3_state_t* state_of(void* state) { return static_cast<XXH3_state_t*>(state); }

}  // namespace

OutputFile::OutputFile(std::string path, std::string name)
    : path_(std::move(path)), name_(std::move(name)), hash_state_(XXH3_createState()) {
  XXH3_64bits_reset(state_of(hash_state_));
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const int error_number = errno;
    XXH3_freeState(state_of(hash_state_));
    throw Error(MESHRUN_UNAVAILABLE,
                fmt::format("cannot create '{}': {}", path_, std::strerror(error_number)));
  }
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
  XXH3_freeState(state_of(hash_state_));
}

Error OutputFile::failure(const std::string& what, int error_number) const {
  const std::string through = path_ == name_ ? "" : fmt::format(" (through '{}')", path_);
  return Error(MESHRUN_UNAVAILABLE, fmt::format("cannot write '{}'{}: {} ({})", name_, through,
                                                what, std::strerror(error_number)));
}

void OutputFile::write(const void* data, size_t bytes, int64_t file_bytes) {
  const auto* next = static_cast<const char*>(data);
  size_t left = bytes;
  while (left > 0) {
    const ssize_t done = ::write(fd_, next, left);
    if (done < 0 && errno == EINTR) continue;
    if (done <= 0) {
      const int error_number = done < 0 ? errno : ENOSPC;
      const int64_t missing = file_bytes >= 0 ? file_bytes - written_ : int64_t(left);
      throw failure(fmt::format("{} bytes missing, {} written", missing, written_), error_number);
    }
    XXH3_64bits_update(state_of(hash_state_), next, size_t(done));
    next += done;
    left -= size_t(done);
    written_ += done;
  }
}

void OutputFile::sync() {
  if (::fsync(fd_) != 0) {
    throw failure(fmt::format("fsync failed, its {} bytes may not be on the device", written_),
                  errno);
  }
}

void OutputFile::close() {
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    throw failure(fmt::format("close failed, its {} bytes may not be on the device", written_),
                  errno);
  }
}

uint64_t OutputFile::checksum() const { return XXH3_64bits_digest(state_of(hash_state_)); }

WrittenFile write_atomically(const std::string& path,
                             const std::function<void(OutputFile&)>& fill) {
  const std::string temporary = path + ".partial";
  OutputFile out(temporary, path);
  fill(out);
  out.sync();
  out.close();
  std::filesystem::rename(temporary, path);
  sync_directory(std::filesystem::path(path).parent_path().string());
  return {out.bytes_written(), out.checksum()};
}

void write_text_file(const std::string& path, std::string_view text) {
  OutputFile file(path, path);
  file.write(text);
  file.close();
}

void sync_directory(const std::string& dir) {
  const std::string path = dir.empty() ? "." : dir;
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  const int failed = fd < 0 || ::fsync(fd) != 0 ? errno : 0;
  if (fd >= 0) ::close(fd);
  if (failed != 0) {
    throw Error(MESHRUN_UNAVAILABLE,
                fmt::format("cannot fsync folder '{}': {}", path, std::strerror(failed)));
  }
}

uint64_t file_checksum(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  std::vector<char> block(size_t(1) << 20);
  while (in) {
    in.read(block.data(), std::streamsize(block.size()));
    XXH3_64bits_update(state, block.data(), size_t(in.gcount()));
  }
  const uint64_t checksum = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  if (!in.eof()) throw invalid_argument(fmt::format("'{}' cannot be read", path));
  return checksum;
}

std::string checksum_text(uint64_t checksum) { return fmt::format("{:016x}", checksum); }

}  // namespace meshrun
