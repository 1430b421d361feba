// Readers for single config values and the wording of their errors.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "config/schema.hpp"
#include "errors.hpp"
#include "support/suggest.hpp"

namespace meshrun::config_detail {
namespace {

// Long values are cut so that a message stays readable on one line.
constexpr size_t kMaxShown = 60;

std::string shortened(std::string text) {
  if (text.size() > kMaxShown) text = text.substr(0, kMaxShown) + "...";
  return text;
}

std::string number_text(double value) { return fmt::format("{}", value); }

bool is_name_char(char c, bool allow_dash) {
  return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || (allow_dash && c == '-');
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::vector<std::string> quoted_names;
  for (const auto& name : names) quoted_names.push_back(config_detail::quoted(name));
  return join_names(quoted_names);
}

}  // namespace

std::string one_line(std::string_view text) {
  std::string out;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (byte < 0x20 || byte == 0x7f) {
      out += fmt::format("\\x{:02x}", byte);
    } else {
      out += c;
    }
  }
  return out;
}

// fmt, not operator+: GCC 12 reports a false -Wrestrict for "'" + std::string
// at -O2 and above.
std::string quoted(std::string_view text) { return fmt::format("'{}'", shortened(one_line(text))); }

nlohmann::ordered_json to_json(const toml::node& node) {
  if (const auto* table = node.as_table()) {
    nlohmann::ordered_json object = nlohmann::ordered_json::object();
    for (auto&& [key, value] : *table) object[std::string(key.str())] = to_json(value);
    return object;
  }
  if (const auto* array = node.as_array()) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const toml::node& value : *array) list.push_back(to_json(value));
    return list;
  }
  if (const auto* text = node.as_string()) return text->get();
  if (const auto* integer = node.as_integer()) return integer->get();
  if (const auto* number = node.as_floating_point()) {
    // JSON has no infinity or NaN: their TOML spelling, for the plugin to refuse.
    if (!std::isfinite(number->get())) return fmt::format("{}", number->get());
    return number->get();
  }
  if (const auto* flag = node.as_boolean()) return flag->get();
  // Dates and times: their TOML text.
  std::ostringstream text;
  node.visit([&](auto&& value) { text << value; });
  return text.str();
}

namespace {

std::string type_name(toml::node_type type) {
  switch (type) {
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::table:
      return "a table";
    case toml::node_type::date:
      return "a date";
    case toml::node_type::time:
      return "a time";
    case toml::node_type::date_time:
      return "a date-time";
    case toml::node_type::none:
      break;
  }
  return "nothing";
}

// The value as the user would write it, with floats in their shortest form.
std::string render(const toml::node& node) {
  if (const auto* text = node.as_string()) return config_detail::quoted(text->get());
  if (const auto* integer = node.as_integer()) return std::to_string(integer->get());
  if (const auto* floating = node.as_floating_point()) return number_text(floating->get());
  if (const auto* flag = node.as_boolean()) return flag->get() ? "true" : "false";
  if (const auto* array = node.as_array()) {
    std::vector<std::string> elements;
    for (const toml::node& element : *array) elements.push_back(render(element));
    return fmt::format("[{}]", join_names(elements));
  }
  if (node.is_table()) return "{...}";
  std::ostringstream text;
  node.visit([&](const auto& value) { text << value; });
  return text.str();
}

}  // namespace

std::string describe(const toml::node& node) {
  if (node.is_table()) return type_name(node.type());
  return type_name(node.type()) + " (" + shortened(render(node)) + ")";
}

void fail(const SourcePosition& position, const std::string& key, const std::string& what) {
  throw Error(MESHRUN_INVALID_ARGUMENT, one_line(position.str() + ": " + key + ": " + what), key);
}

void fail(const Entry& entry, const std::string& what) { fail(entry.position, entry.key, what); }

void fail_type(const Entry& entry, const std::string& expected) {
  std::string what = "expected " + expected + ", got " + describe(*entry.node);
  if (!entry.toml_error.empty()) {
    what += "; the override value was read as a string because it is not a TOML value (" +
            entry.toml_error + ")";
  }
  fail(entry, what);
}

bool NumberRange::contains(double value) const {
  if (!std::isfinite(value)) return false;
  const bool above = min_inclusive ? value >= min : value > min;
  const bool below = max_inclusive ? value <= max : value < max;
  return above && below;
}

std::string NumberRange::describe() const {
  if (std::isinf(max)) {
    return "a finite number " + std::string(min_inclusive ? ">= " : "> ") + number_text(min);
  }
  return "a number in " + std::string(min_inclusive ? "[" : "(") + number_text(min) + ", " +
         number_text(max) + (max_inclusive ? "]" : ")");
}

int64_t read_integer(const Entry& entry, int64_t min, int64_t max) {
  const std::string expected =
      max == kNoMax ? "an integer >= " + std::to_string(min)
                    : "an integer from " + std::to_string(min) + " to " + std::to_string(max);
  const auto* value = entry.node->as_integer();
  if (value == nullptr) fail_type(entry, expected);
  if (value->get() < min || value->get() > max) {
    fail(entry, "expected " + expected + ", got " + std::to_string(value->get()));
  }
  return value->get();
}

std::optional<double> number_value(const toml::node& node) {
  if (const auto* integer = node.as_integer()) return static_cast<double>(integer->get());
  if (const auto* floating = node.as_floating_point()) return floating->get();
  return std::nullopt;
}

double read_number(const Entry& entry, const NumberRange& range) {
  const std::optional<double> value = number_value(*entry.node);
  if (!value) fail_type(entry, range.describe());
  if (!range.contains(*value)) {
    fail(entry, "expected " + range.describe() + ", got " + number_text(*value));
  }
  return *value;
}

bool read_boolean(const Entry& entry) {
  const auto* value = entry.node->as_boolean();
  if (value == nullptr) fail_type(entry, "a boolean (true or false)");
  return value->get();
}

std::string read_string(const Entry& entry) {
  const auto* value = entry.node->as_string();
  if (value == nullptr) fail_type(entry, "a string");
  return value->get();
}

std::string read_path(const Entry& entry) {
  std::string path = read_string(entry);
  if (path.empty()) fail(entry, "expected a non-empty path, got ''");
  return path;
}

std::string read_name(const Entry& entry, bool allow_dash) {
  const std::string pattern = allow_dash ? "[a-z0-9_-]+" : "[a-z0-9_]+";
  const std::string expected = "a name of lowercase letters, digits" +
                               std::string(allow_dash ? ", '_' and '-'" : " and '_'") + " (" +
                               pattern + ")";
  const auto* value = entry.node->as_string();
  if (value == nullptr) fail_type(entry, expected);
  const std::string& name = value->get();
  const bool valid = !name.empty() && std::all_of(name.begin(), name.end(), [&](char c) {
    return is_name_char(c, allow_dash);
  });
  if (!valid) fail(entry, "expected " + expected + ", got " + config_detail::quoted(name));
  return name;
}

std::string read_choice(const Entry& entry, const std::vector<std::string>& choices) {
  const std::string expected = "one of " + quoted_list(choices);
  const auto* value = entry.node->as_string();
  if (value == nullptr) fail_type(entry, expected);
  const std::string& choice = value->get();
  if (std::find(choices.begin(), choices.end(), choice) == choices.end()) {
    fail(entry, "expected " + expected + ", got " + config_detail::quoted(choice) +
                    did_you_mean(choice, choices));
  }
  return choice;
}

const Field* TableSchema::find(std::string_view name) const {
  const auto it =
      std::find_if(fields.begin(), fields.end(), [&](const Field& f) { return f.name == name; });
  return it == fields.end() ? nullptr : &*it;
}

std::vector<std::string> TableSchema::names() const {
  std::vector<std::string> result;
  for (const auto& field : fields) result.push_back(field.name);
  return result;
}

}  // namespace meshrun::config_detail
