#include "common/config_reader.hpp"

#include "common/parameters.hpp"

#include <cmath>
#include <stdexcept>

namespace meshrun::models {

ConfigReader::ConfigReader(const char* config_json) {
  try {
    config_ = nlohmann::json::parse(config_json);
  } catch (const nlohmann::json::exception& error) {
    throw std::invalid_argument(std::string("model: the config is not JSON: ") + error.what());
  }
  if (!config_.is_object()) throw std::invalid_argument("model: the config is not a JSON object");
}

void ConfigReader::fail(const char* key, const std::string& expected) const {
  throw std::invalid_argument("model." + std::string(key) + ": expected " + expected + ", got " +
                              config_.at(key).dump());
}

int64_t ConfigReader::integer(const char* key, int64_t fallback, int64_t min, int64_t max) const {
  if (!has(key)) return fallback;
  const auto& value = config_.at(key);
  if (!value.is_number_integer() || value.get<int64_t>() < min || value.get<int64_t>() > max) {
    fail(key, max == std::numeric_limits<int64_t>::max()
                  ? "an integer >= " + std::to_string(min)
                  : "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return value.get<int64_t>();
}

int64_t ConfigReader::dimension(const char* key, int64_t fallback) const {
  constexpr int64_t kFloatBytes = 4;
  const int64_t value = integer(key, fallback);
  if (value > kMaxParameterBytes / kFloatBytes) {
    refuse_unaddressable(key, value, double(value) * kFloatBytes);
  }
  return value;
}

int64_t ConfigReader::nullable_integer(const char* key, int64_t fallback, int64_t min) const {
  return has(key) && config_.at(key).is_null() ? fallback : integer(key, fallback, min);
}

double ConfigReader::positive_number(const char* key, double fallback) const {
  if (!has(key)) return fallback;
  const auto& value = config_.at(key);
  if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() <= 0) {
    fail(key, "a finite number > 0");
  }
  return value.get<double>();
}

double ConfigReader::non_negative_number(const char* key, double fallback) const {
  if (!has(key)) return fallback;
  const auto& value = config_.at(key);
  if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() < 0) {
    fail(key, "a finite number >= 0");
  }
  return value.get<double>();
}

double ConfigReader::fraction(const char* key, double fallback) const {
  if (!has(key)) return fallback;
  const auto& value = config_.at(key);
  if (!value.is_number() || value.get<double>() < 0 || value.get<double>() >= 1) {
    fail(key, "a number in [0, 1)");
  }
  return value.get<double>();
}

bool ConfigReader::boolean(const char* key, bool fallback) const {
  if (!has(key)) return fallback;
  if (!config_.at(key).is_boolean()) fail(key, "a boolean (true or false)");
  return config_.at(key).get<bool>();
}

std::string ConfigReader::choice(const char* key, const std::string& fallback,
                                 const std::initializer_list<const char*>& choices) const {
  if (!has(key)) return fallback;
  const auto& value = config_.at(key);
  std::string names;
  for (const char* choice : choices) {
    if (value.is_string() && value.get<std::string>() == choice) return choice;
    names += (names.empty() ? "'" : ", '") + std::string(choice) + "'";
  }
  fail(key, "one of " + names);
}

void ConfigReader::require_number(const char* key, double only, const std::string& why) const {
  if (!has(key)) return;
  const auto& value = config_.at(key);
  if (!value.is_number() || value.get<double>() != only) {
    fail(key, nlohmann::json(only).dump() + " (" + why + ")");
  }
}

}  // namespace meshrun::models
