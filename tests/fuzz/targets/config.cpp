// Fuzz target: the TOML config loader and its schema (meshrun plan and
// train read every config through parse_config).
#include <string_view>

#include "config/config.hpp"
#include "fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  meshrun::fuzz::refuse_or_accept([&] { meshrun::parse_config(text, "fuzz.toml", {}); });
  return 0;
}
