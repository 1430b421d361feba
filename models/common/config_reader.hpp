// Reading a model's [model] keys (meshrun/model.h model_create): the JSON
// object of the keys the user set, each checked for its type and range with
// a message that begins with the dotted key, as the host expects. Shared by
// the shipped model plugins.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

namespace meshrun::models {

class ConfigReader {
 public:
  // Throws std::invalid_argument("model: ...") when `config_json` is not a
  // JSON object.
  explicit ConfigReader(const char* config_json);

  bool has(const char* key) const { return config_.contains(key); }
  // The value of `key` when set, else `fallback`. Throws
  // std::invalid_argument("model.<key>: expected ..., got ...").
  int64_t integer(const char* key, int64_t fallback, int64_t min = 1,
                  int64_t max = std::numeric_limits<int64_t>::max()) const;
  // A size of parameter tensors (>= 1): one larger than a parameter of
  // kMaxParameterBytes could hold is refused with the bytes it would take,
  // so that products and multiples of sizes cannot overflow.
  int64_t dimension(const char* key, int64_t fallback) const;
  // As integer(), with JSON null as unset (Hugging Face writes some
  // defaults as null, "n_inner": null).
  int64_t nullable_integer(const char* key, int64_t fallback, int64_t min = 1) const;
  double positive_number(const char* key, double fallback) const;
  double non_negative_number(const char* key, double fallback) const;
  double fraction(const char* key, double fallback) const;  // in [0, 1)
  bool boolean(const char* key, bool fallback) const;
  std::string choice(const char* key, const std::string& fallback,
                     const std::initializer_list<const char*>& choices) const;
  // Throws unless `key` is unset or the number `only`; `why` says why no
  // other value is taken.
  void require_number(const char* key, double only, const std::string& why) const;

 private:
  [[noreturn]] void fail(const char* key, const std::string& expected) const;
  nlohmann::json config_;
};

}  // namespace meshrun::models
