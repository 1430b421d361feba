// Internal to core/config: the table-driven schema of the TOML config. Each
// table lists its keys once (name, reader, destination field, owning
// strategy), so the valid-key lists in error messages and the readers can
// never disagree. Includes toml++, so only core/config may include it.
#pragma once

#include <toml++/toml.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.hpp"

namespace meshrun::config_detail {

// One key of the document as it is applied: its value, dotted path and origin.
struct Entry {
  const toml::node* node = nullptr;
  std::string key;
  SourcePosition position;
  // Set when an override value was not valid TOML and was read as a bare
  // string: says why, so a type error can explain the fallback.
  std::string toml_error;
};

// Throws meshrun::Error: "POSITION: key: what", on one line.
[[noreturn]] void fail(const SourcePosition& position, const std::string& key,
                       const std::string& what);
[[noreturn]] void fail(const Entry& entry, const std::string& what);
// "expected <expected>, got <what the node is>".
[[noreturn]] void fail_type(const Entry& entry, const std::string& expected);

// The most levels a config may nest, and the longest key part. A meshrun
// config nests 3 deep and its keys are words; Hugging Face configs fit too.
inline constexpr int kMaxNesting = 32;
inline constexpr size_t kMaxKeyBytes = 256;
// Throws meshrun::Error "source:line:col: ..." when `text` nests deeper or
// has a longer key (shape.cpp says why toml++ must not read such a text).
void check_toml_shape(std::string_view text, const std::string& source);

// A message fragment with control characters escaped, so messages stay on one line.
std::string one_line(std::string_view text);
// 'text', escaped and shortened.
std::string quoted(std::string_view text);
// "a string ('x')", "an integer (3)", "an array ([1, 2])", ...
std::string describe(const toml::node& node);

inline constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();

// An interval of finite numbers.
struct NumberRange {
  double min = 0;
  bool min_inclusive = true;
  double max = std::numeric_limits<double>::infinity();
  bool max_inclusive = false;
  bool contains(double value) const;
  std::string describe() const;  // "a finite number > 0", "a number in [0, 1)"
};
inline constexpr NumberRange kPositive{0, false};
inline constexpr NumberRange kNonNegative{0, true};
inline constexpr NumberRange kFraction{0, true, 1, false};

// The value of an integer or float node; nullopt for other types.
std::optional<double> number_value(const toml::node& node);

// The node's value as JSON (tables become objects, arrays arrays).
nlohmann::ordered_json to_json(const toml::node& node);

// Readers: check type and range, or fail with what would be valid.
int64_t read_integer(const Entry& entry, int64_t min, int64_t max = kNoMax);
double read_number(const Entry& entry, const NumberRange& range);  // integers accepted
bool read_boolean(const Entry& entry);
std::string read_string(const Entry& entry);
std::string read_path(const Entry& entry);  // a non-empty string
// A plugin-style name: lowercase letters, digits, '_' (and '-' when allowed).
std::string read_name(const Entry& entry, bool allow_dash = false);
std::string read_choice(const Entry& entry, const std::vector<std::string>& choices);

using Apply = std::function<void(const Entry&, Config&)>;

struct TableSchema;

// A key of a table: a value with its reader, or a sub-table.
struct Field {
  std::string name;
  Apply apply;                         // value keys
  const TableSchema* table = nullptr;  // sub-tables
  std::string strategy;                // non-empty: only valid with this strategy
};

struct TableSchema {
  std::string path;                         // dotted; "" for the document root
  void (*mark_present)(Config&) = nullptr;  // tables whose presence matters
  std::vector<Field> fields;
  // An open table takes keys beyond `fields` through `other` ([model]: the
  // architecture keys, which the model plugin checks); a closed one (null)
  // refuses them.
  Apply other;

  const Field* find(std::string_view name) const;
  std::vector<std::string> names() const;
};

// Builds the fields of one table whose values live in section S of Config.
template <class S>
class TableBuilder {
 public:
  using Section = S& (*)(Config&);
  explicit TableBuilder(Section section) : section_(section) {}

  TableBuilder& integer(std::string name, int64_t S::*member, int64_t min, int64_t max = kNoMax) {
    return set(std::move(name), member, [=](const Entry& e) { return read_integer(e, min, max); });
  }
  TableBuilder& number(std::string name, double S::*member, NumberRange range) {
    return set(std::move(name), member, [=](const Entry& e) { return read_number(e, range); });
  }
  TableBuilder& boolean(std::string name, bool S::*member) {
    return set(std::move(name), member, read_boolean);
  }
  TableBuilder& optional_boolean(std::string name, std::optional<bool> S::*member) {
    return set(std::move(name), member, read_boolean);
  }
  TableBuilder& string(std::string name, std::string S::*member) {
    return set(std::move(name), member, read_string);
  }
  TableBuilder& path(std::string name, std::string S::*member) {
    return set(std::move(name), member, read_path);
  }
  TableBuilder& name(std::string name, std::string S::*member) {
    return set(std::move(name), member, [](const Entry& e) { return read_name(e); });
  }
  TableBuilder& choice(std::string name, std::string S::*member, std::vector<std::string> choices) {
    return set(std::move(name), member, [=](const Entry& e) { return read_choice(e, choices); });
  }
  TableBuilder& custom(std::string name, Apply apply) {
    fields_.push_back(Field{std::move(name), std::move(apply), nullptr, strategy_});
    return *this;
  }
  TableBuilder& table(std::string name, const TableSchema& schema) {
    fields_.push_back(Field{std::move(name), nullptr, &schema, strategy_});
    return *this;
  }
  // The keys added after this call belong to `strategy` only.
  TableBuilder& owned_by(std::string strategy) {
    strategy_ = std::move(strategy);
    return *this;
  }
  std::vector<Field> build() { return std::move(fields_); }

 private:
  template <class T, class Reader>
  TableBuilder& set(std::string name, T S::*member, Reader reader) {
    const Section section = section_;
    return custom(std::move(name), [=](const Entry& entry, Config& config) {
      section(config).*member = reader(entry);
    });
  }

  Section section_;
  std::string strategy_;
  std::vector<Field> fields_;
};

// The document's root: the tables [model], [data], ... and their keys.
const TableSchema& root_schema();

// The rules that involve more than one key; run after every key is applied.
void check_cross_key_rules(Config& config);

}  // namespace meshrun::config_detail
