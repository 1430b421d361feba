// Input errors of a training run, in the config's format: "FILE:LINE:COL:
// key: what" (Config::where), so the CLI prints one line naming the key.
#pragma once

#include <string>

#include "config/config.hpp"
#include "errors.hpp"

namespace meshrun {

inline Error config_error(const Config& config, const std::string& key, const std::string& what) {
  return Error(MESHRUN_INVALID_ARGUMENT, config.where(key) + ": " + key + ": " + what, key);
}

}  // namespace meshrun
