// Errors inside the core. One exception type carrying an ABI error code; the
// host API turns it into a meshrun_error, the CLI into an exit status
// (2 for bad input, 1 otherwise).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "meshrun/error.h"

namespace meshrun {

class Error : public std::runtime_error {
 public:
  Error(int32_t code, const std::string& message, std::string key = {})
      : std::runtime_error(message), code_(code), key_(std::move(key)) {}
  int32_t code() const noexcept { return code_; }
  // The config key (dotted path) the error is about, when there is one, so a
  // caller that knows the config can prefix the key's file position.
  const std::string& key() const noexcept { return key_; }
  // Bad input from the user (config, sizes, names, a plugin of an ABI
  // version this build cannot use): the CLI exits with 2.
  bool is_input_error() const noexcept {
    return code_ == MESHRUN_INVALID_ARGUMENT || code_ == MESHRUN_NOT_FOUND ||
           code_ == MESHRUN_OUT_OF_RANGE || code_ == MESHRUN_VERSION_MISMATCH;
  }

 private:
  int32_t code_;
  std::string key_;
};

// Shorthand for the most common kind: an error in what the user gave us.
inline Error invalid_argument(const std::string& message) {
  return Error(MESHRUN_INVALID_ARGUMENT, message);
}

}  // namespace meshrun
