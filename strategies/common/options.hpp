// Typed reading of a strategy's options: the [distributed] config as one
// JSON object with AutoModel's key names. Keys a strategy does not read are
// ignored (the host sends the whole table); a key it reads with a value of
// the wrong type or range is INVALID_ARGUMENT naming the key.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace meshrun::strategies {

using Json = nlohmann::json;

// options_json as a JSON object; INVALID_ARGUMENT when it is NULL, not JSON
// or not an object.
Json parse_options(const char* options_json);

// Reads the keys of one JSON object; a missing key takes the fallback.
// Nested objects are read with a reader whose key names carry the path
// ("mp_policy.param_dtype").
class OptionReader {
 public:
  explicit OptionReader(const Json& object, std::string path = "");

  bool boolean(const char* key, bool fallback) const;
  // true, false, or unset (null or missing).
  std::optional<bool> optional_boolean(const char* key) const;
  int64_t integer(const char* key, int64_t fallback, int64_t minimum) const;
  // A positive finite number, or unset (null or missing).
  std::optional<double> positive_number(const char* key) const;
  // One of `allowed`.
  std::string choice(const char* key, const std::string& fallback,
                     const std::vector<std::string>& allowed) const;
  // The object at `key` (an empty one when missing).
  OptionReader object(const char* key) const;

 private:
  const Json* find(const char* key) const;
  [[noreturn]] void reject(const char* key, const std::string& expected, const Json& value) const;

  const Json* object_;
  std::string path_;
};

}  // namespace meshrun::strategies
