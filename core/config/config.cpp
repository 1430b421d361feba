// Loading a config: parse the TOML, splice in the command-line overrides,
// then apply every key through the schema (schema.cpp) in source order, so
// that the first error reported is the first one in the file.
#include "config/config.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <tuple>

#include "config/schema.hpp"
#include "errors.hpp"
#include "support/suggest.hpp"

namespace meshrun {
namespace {

using config_detail::Entry;
using config_detail::Field;
using config_detail::one_line;
using config_detail::quoted;
using config_detail::TableSchema;

// A config is a few kilobytes; the cap keeps a wrong path such as /dev/zero
// from reading forever.
constexpr size_t kMaxConfigBytes = size_t{16} << 20;

// Where an override put a value or created a table.
struct OverrideOrigin {
  SourcePosition position;
  int ordinal = 0;  // 1-based order on the command line; file keys sort before
  std::string toml_error;
};
using OverrideOrigins = std::map<std::string, OverrideOrigin>;

// A key of the document, waiting to be applied in source order.
struct FoundKey {
  Entry entry;
  std::string name;  // the last part of the dotted key
  const TableSchema* parent = nullptr;
  const Field* field = nullptr;             // nullptr: not in the schema
  std::tuple<int, int64_t, int64_t> order;  // (override ordinal, line, column)
};

toml::table parse_document(std::string_view text, const std::string& source) {
  config_detail::check_toml_shape(text, source);
  try {
    return toml::parse(text, std::string_view(source));
  } catch (const toml::parse_error& error) {
    const SourcePosition position{source, error.source().begin.line, error.source().begin.column};
    throw Error(
        MESHRUN_INVALID_ARGUMENT,
        one_line(position.str() + ": TOML syntax error: " + std::string(error.description())));
  }
}

[[noreturn]] void fail_malformed(const std::string& text, const std::string& why) {
  throw Error(MESHRUN_INVALID_ARGUMENT,
              one_line("override '" + text + "': malformed override (" + why +
                       "); expected key.path=value, e.g. distributed.tp_size=2"));
}

std::vector<std::string> split_key(const std::string& key, const std::string& text) {
  if (key.empty()) fail_malformed(text, "empty key");
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    parts.push_back(key.substr(start, dot - start));
    if (parts.back().empty())
      fail_malformed(text, "empty part in key " + config_detail::quoted(key));
    if (parts.back().size() > config_detail::kMaxKeyBytes) {
      fail_malformed(text,
                     fmt::format("a key part longer than {} bytes", config_detail::kMaxKeyBytes));
    }
    if (parts.size() > size_t(config_detail::kMaxNesting)) {
      fail_malformed(text, fmt::format("more than {} parts", config_detail::kMaxNesting));
    }
    if (dot == std::string::npos) return parts;
    start = dot + 1;
  }
}

// The override's value as the one-entry table {v = value}: its TOML reading
// when it is a single TOML value, else the bare string.
toml::table parse_override_value(const std::string& value, const std::string& text,
                                 std::string& toml_error) {
  const std::string document_text = "v = " + value;
  config_detail::check_toml_shape(document_text, "override '" + one_line(text) + "'");
  try {
    toml::table document = toml::parse(std::string_view(document_text));
    if (document.size() == 1) return document;
    toml_error = "more than one key";
  } catch (const toml::parse_error& error) {
    toml_error = std::string(error.description());
  }
  toml::table document;
  document.insert("v", value);
  return document;
}

void apply_override(toml::table& root, const std::string& text, int ordinal,
                    OverrideOrigins& origins) {
  const size_t equals = text.find('=');
  if (equals == std::string::npos) fail_malformed(text, "no '='");
  const std::string key = text.substr(0, equals);
  const std::vector<std::string> parts = split_key(key, text);
  OverrideOrigin origin{SourcePosition{"override '" + one_line(text) + "'"}, ordinal, {}};

  toml::table* table = &root;
  std::string path;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    path += (i == 0 ? "" : ".") + parts[i];
    toml::node* node = table->get(parts[i]);
    if (node == nullptr) {
      node = &table->insert(parts[i], toml::table{}).first->second;
      origins[path] = origin;
    }
    if (!node->is_table()) config_detail::fail_type({node, path, origin.position, {}}, "a table");
    table = node->as_table();
  }
  toml::table value = parse_override_value(text.substr(equals + 1), text, origin.toml_error);
  value.get("v")->visit(
      [&](auto&& node) { table->insert_or_assign(parts.back(), std::move(node)); });
  origins[key] = origin;
}

// Fills in the key's position: the override that set it, else the key's
// place in the file (the value's when the key has none).
void locate(FoundKey& found, const toml::key& key, const toml::node& node,
            const std::string& source, const OverrideOrigins& origins) {
  if (const auto it = origins.find(found.entry.key); it != origins.end()) {
    found.entry.position = it->second.position;
    found.entry.toml_error = it->second.toml_error;
    found.order = {it->second.ordinal, 0, 0};
    return;
  }
  const toml::source_position begin = key.source().begin ? key.source().begin : node.source().begin;
  found.entry.position = SourcePosition{source, begin.line, begin.column};
  found.order = {0, begin.line, begin.column};
}

void collect(const toml::table& table, const TableSchema& schema, const std::string& prefix,
             const std::string& source, const OverrideOrigins& origins,
             std::vector<FoundKey>& found) {
  for (auto&& [key, node] : table) {
    FoundKey item;
    item.name = std::string(key.str());
    item.entry.node = &node;
    item.entry.key = prefix.empty() ? item.name : prefix + "." + item.name;
    item.parent = &schema;
    item.field = schema.find(item.name);
    locate(item, key, node, source, origins);
    found.push_back(item);
    if (item.field != nullptr && item.field->table != nullptr && node.is_table()) {
      collect(*node.as_table(), *item.field->table, item.entry.key, source, origins, found);
    }
  }
}

// The table other than `except` that has a key called `name`, or nullptr.
const TableSchema* table_with_key(const TableSchema& schema, const std::string& name,
                                  const TableSchema* except) {
  if (&schema != except && schema.find(name) != nullptr) return &schema;
  for (const Field& field : schema.fields) {
    if (field.table == nullptr) continue;
    if (const TableSchema* found = table_with_key(*field.table, name, except)) return found;
  }
  return nullptr;
}

void list_keys(const TableSchema& schema, std::vector<std::string>& keys) {
  for (const Field& field : schema.fields) {
    if (field.table != nullptr) {
      list_keys(*field.table, keys);
    } else {
      keys.push_back(schema.path + "." + field.name);
    }
  }
}

// " (did you mean 'x'?)" for a typo, " (it belongs in [t])" for a key put in
// the wrong table, else "".
std::string suggestion(const FoundKey& found, const std::vector<std::string>& names) {
  const std::string typo = did_you_mean(found.name, names);
  if (!typo.empty()) return typo;
  const TableSchema* home = table_with_key(config_detail::root_schema(), found.name, found.parent);
  if (home == nullptr) return "";
  return home->path.empty() ? " (it is a table of its own)"
                            : " (it belongs in [" + home->path + "])";
}

[[noreturn]] void fail_unknown(const FoundKey& found) {
  const std::vector<std::string> names = found.parent->names();
  const std::string valid = found.parent->path.empty()
                                ? "valid tables: "
                                : "valid keys in [" + found.parent->path + "]: ";
  const std::string what = (found.entry.node->is_table() ? "unknown table " : "unknown key ") +
                           config_detail::quoted(found.entry.key) + suggestion(found, names) +
                           "; " + valid + join_names(names);
  throw Error(MESHRUN_INVALID_ARGUMENT, one_line(found.entry.position.str() + ": " + what),
              found.entry.key);
}

void apply(const FoundKey& found, Config& config) {
  if (found.field == nullptr && found.parent->other) {
    found.parent->other(found.entry, config);
    config.positions[found.entry.key] = found.entry.position;
    return;
  }
  if (found.field == nullptr) fail_unknown(found);
  if (const TableSchema* table = found.field->table) {
    if (!found.entry.node->is_table()) config_detail::fail_type(found.entry, "a table");
    if (table->mark_present != nullptr) table->mark_present(config);
  } else {
    found.field->apply(found.entry, config);
  }
  config.positions[found.entry.key] = found.entry.position;
}

std::string read_file(const std::string& path) {
  const auto cannot_read = [&](const std::string& why) {
    return Error(MESHRUN_NOT_FOUND, one_line("cannot read config file '" + path + "': " + why));
  };
  const std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) throw cannot_read(std::strerror(errno));
  std::string text;
  char buffer[1 << 16];
  size_t count = 0;
  while ((count = std::fread(buffer, 1, sizeof buffer, file.get())) > 0) {
    text.append(buffer, count);
    if (text.size() > kMaxConfigBytes) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  one_line("config file '" + path + "' is larger than 16 MiB; is it a config?"));
    }
  }
  if (std::ferror(file.get())) throw cannot_read(std::strerror(errno));
  return text;
}

}  // namespace

std::string SourcePosition::str() const {
  if (line == 0) return source;
  return source + ":" + std::to_string(line) + ":" + std::to_string(column);
}

std::string Config::where(std::string_view key) const {
  const auto it = positions.find(std::string(key));
  return it == positions.end() ? source : it->second.str();
}

Config parse_config(std::string_view toml_text, const std::string& source_name,
                    const std::vector<std::string>& overrides) {
  toml::table root = parse_document(toml_text, source_name);
  OverrideOrigins origins;
  for (size_t i = 0; i < overrides.size(); ++i) {
    apply_override(root, overrides[i], static_cast<int>(i) + 1, origins);
  }
  std::vector<FoundKey> found;
  collect(root, config_detail::root_schema(), "", source_name, origins, found);
  std::stable_sort(found.begin(), found.end(),
                   [](const FoundKey& a, const FoundKey& b) { return a.order < b.order; });

  Config config;
  config.source = source_name;
  for (const FoundKey& item : found) apply(item, config);
  config_detail::check_cross_key_rules(config);
  return config;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_config(read_file(path), path, overrides);
}

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  list_keys(config_detail::root_schema(), keys);
  return keys;
}

std::string misplaced_key_hint(std::string_view name, std::string_view table) {
  const TableSchema& root = config_detail::root_schema();
  const TableSchema* except = root.find(table) != nullptr ? root.find(table)->table : nullptr;
  const TableSchema* home = table_with_key(root, std::string(name), except);
  if (home == nullptr || home->path.empty()) return "";
  return " (it belongs in [" + home->path + "])";
}

std::string canonical_strategy_name(std::string_view name) {
  if (name == "megatron-fsdp" || name == "mfsdp") return "megatron_fsdp";
  return std::string(name);
}

}  // namespace meshrun
