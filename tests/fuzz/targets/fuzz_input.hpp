// What the fuzz targets share: the input written to a file for readers that
// take a path, and the rule that bad input may only be refused with a
// meshrun::Error of the input kinds (exit status 2 in the CLI). Anything
// else escaping a reader (another exception, a crash, a sanitizer report)
// is a finding.
#pragma once

#include <unistd.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "errors.hpp"

namespace meshrun::fuzz {

// A directory of this process's own, made once and removed at exit.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    std::string pattern = (std::filesystem::temp_directory_path() / "meshrun-fuzz-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) {
      std::perror("meshrun fuzz: mkdtemp");
      std::abort();
    }
    std::atexit([] { std::filesystem::remove_all(scratch_dir()); });
    return std::filesystem::path(pattern);
  }();
  return dir;
}

// Writes `size` bytes to `name` in the scratch directory; returns its path.
inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::filesystem::path path = scratch_dir() / name;
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), std::streamsize(size));
  return path.string();
}

// Runs `read`; a refusal of the input is the expected outcome of most inputs.
template <class Read>
void refuse_or_accept(Read&& read) {
  try {
    read();
  } catch (const Error& error) {
    if (!error.is_input_error()) {
      std::fprintf(stderr, "meshrun fuzz: bad input gave a non-input error: %s\n", error.what());
      std::abort();
    }
  }
}

}  // namespace meshrun::fuzz
