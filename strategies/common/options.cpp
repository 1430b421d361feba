#include "common/options.hpp"

#include <cmath>

#include "common/errors.hpp"

namespace meshrun::strategies {

Json parse_options(const char* options_json) {
  if (options_json == nullptr) invalid("setup: options_json is NULL");
  Json options;
  try {
    options = Json::parse(options_json);
  } catch (const Json::parse_error& e) {
    invalid(std::string("setup: options_json is not JSON: ") + e.what());
  }
  if (!options.is_object()) invalid("setup: options_json must be a JSON object");
  return options;
}

OptionReader::OptionReader(const Json& object, std::string path)
    : object_(&object), path_(std::move(path)) {}

const Json* OptionReader::find(const char* key) const {
  const auto found = object_->find(key);
  return found == object_->end() ? nullptr : &*found;
}

void OptionReader::reject(const char* key, const std::string& expected, const Json& value) const {
  invalid("option '" + path_ + key + "' must be " + expected + ", not " + value.dump());
}

bool OptionReader::boolean(const char* key, bool fallback) const {
  const Json* value = find(key);
  if (value == nullptr) return fallback;
  if (!value->is_boolean()) reject(key, "true or false", *value);
  return value->get<bool>();
}

std::optional<bool> OptionReader::optional_boolean(const char* key) const {
  const Json* value = find(key);
  if (value == nullptr || value->is_null()) return std::nullopt;
  if (!value->is_boolean()) reject(key, "true, false or null", *value);
  return value->get<bool>();
}

int64_t OptionReader::integer(const char* key, int64_t fallback, int64_t minimum) const {
  const Json* value = find(key);
  if (value == nullptr) return fallback;
  if (!value->is_number_integer() || value->get<int64_t>() < minimum) {
    reject(key, "an integer >= " + std::to_string(minimum), *value);
  }
  return value->get<int64_t>();
}

std::optional<double> OptionReader::positive_number(const char* key) const {
  const Json* value = find(key);
  if (value == nullptr || value->is_null()) return std::nullopt;
  if (!value->is_number() || !std::isfinite(value->get<double>()) || value->get<double>() <= 0) {
    reject(key, "a positive number", *value);
  }
  return value->get<double>();
}

std::string OptionReader::choice(const char* key, const std::string& fallback,
                                 const std::vector<std::string>& allowed) const {
  const Json* value = find(key);
  if (value == nullptr) return fallback;
  if (value->is_string()) {
    for (const std::string& name : allowed) {
      if (*value == name) return name;
    }
  }
  std::string names;
  for (const std::string& name : allowed) names += (names.empty() ? "\"" : ", \"") + name + "\"";
  reject(key, "one of " + names, *value);
}

OptionReader OptionReader::object(const char* key) const {
  static const Json kEmpty = Json::object();
  const Json* value = find(key);
  if (value == nullptr) return OptionReader(kEmpty, path_ + key + ".");
  if (!value->is_object()) reject(key, "an object", *value);
  return OptionReader(*value, path_ + key + ".");
}

}  // namespace meshrun::strategies
