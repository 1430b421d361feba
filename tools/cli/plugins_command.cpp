// meshrun plugins [--kind strategy|schedule|sidecar|comm|model] [--json]
//
// Every plugin file on the search path, grouped by kind and name, the file
// that would be loaded first and the ones it shadows after it, each with the
// error that keeps it from loading, if any.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "errors.hpp"
#include "plugin/loader.hpp"
#include "support/suggest.hpp"

namespace meshrun::cli {
namespace {

// Known kinds in their ABI order, then kinds only a file name spells.
int kind_order(const std::string& kind) {
  const auto known = plugin_kind_from_name(kind);
  return known ? static_cast<int>(*known) : 1000;
}

std::string abi_text(const PluginInfo& info) {
  if (!info.error.empty()) return "-";
  return std::to_string(info.abi_major) + "." + std::to_string(info.abi_minor);
}

std::string file_text(const PluginInfo& info) {
  return info.shadowed ? info.path + " (shadowed)" : info.path;
}

std::string to_text(const std::vector<PluginInfo>& rows, const std::vector<std::string>& dirs) {
  const std::vector<std::string> header = {"KIND", "NAME", "ABI", "VERSION", "FILE"};
  std::vector<std::vector<std::string>> cells;
  for (const auto& row : rows) {
    cells.push_back(
        {row.kind, row.name, abi_text(row), row.error.empty() ? row.version : "-", file_text(row)});
  }
  std::vector<size_t> widths;
  for (const auto& title : header) widths.push_back(title.size());
  for (const auto& line : cells) {
    for (size_t i = 0; i < line.size(); ++i) widths[i] = std::max(widths[i], line[i].size());
  }
  const auto format_line = [&](const std::vector<std::string>& line) {
    std::string text;
    for (size_t i = 0; i < line.size(); ++i) {
      text += line[i];
      if (i + 1 < line.size()) text += std::string(widths[i] - line[i].size() + 2, ' ');
    }
    return text + "\n";
  };

  std::string text;
  if (rows.empty()) {
    text += "no plugins found\n";
  } else {
    text += format_line(header);
    for (size_t i = 0; i < rows.size(); ++i) {
      text += format_line(cells[i]);
      if (!rows[i].error.empty()) {
        text += "    error: " + rows[i].error + "\n";
      } else if (!rows[i].description.empty()) {
        text += "    " + rows[i].description + "\n";
      }
    }
  }
  text += "searched: " + (dirs.empty() ? std::string("no directories") : join_names(dirs)) +
          " (add directories with MESHRUN_PLUGIN_PATH)\n";
  return text;
}

nlohmann::json to_json(const std::vector<PluginInfo>& rows, const std::vector<std::string>& dirs) {
  nlohmann::json plugins = nlohmann::json::array();
  for (const auto& row : rows) {
    nlohmann::json entry = {
        {"kind", row.kind},
        {"name", row.name},
        {"file", row.path},
        {"shadowed", row.shadowed},
    };
    if (row.error.empty()) {
      entry["abi_version"] = abi_text(row);
      entry["version"] = row.version;
      entry["description"] = row.description;
      entry["error"] = nullptr;
    } else {
      entry["abi_version"] = nullptr;
      entry["version"] = nullptr;
      entry["description"] = nullptr;
      entry["error"] = row.error;
    }
    plugins.push_back(std::move(entry));
  }
  return {{"search_path", dirs}, {"plugins", std::move(plugins)}};
}

}  // namespace

int run_plugins(const Args& args) {
  try {
    const ParsedArgs parsed =
        parse_args(args, {{"kind", true}, {"json", false}, {"help", false}}, "plugins");
    if (parsed.has_flag("help")) {
      std::puts("usage: meshrun plugins [--kind strategy|schedule|sidecar|comm|model] [--json]");
      return 0;
    }
    if (!parsed.positionals.empty() || !parsed.overrides.empty()) {
      const std::string extra =
          parsed.positionals.empty() ? parsed.overrides.front() : parsed.positionals.front();
      throw invalid_argument("meshrun plugins: unexpected argument '" + extra +
                             "'; usage: meshrun plugins [--kind KIND] [--json]");
    }
    std::optional<PluginKind> kind;
    if (const auto kind_name = parsed.value("kind")) {
      kind = plugin_kind_from_name(*kind_name);
      if (!kind) {
        throw invalid_argument("meshrun plugins: unknown kind '" + *kind_name + "'" +
                               did_you_mean(*kind_name, plugin_kind_names()) +
                               "; valid kinds: " + join_names(plugin_kind_names()));
      }
    }

    const PluginLoader loader = PluginLoader::from_environment();
    std::vector<PluginInfo> rows = loader.list(kind);
    // Search order within a (kind, name): the file that loads comes first,
    // the files it shadows follow it.
    std::stable_sort(rows.begin(), rows.end(), [](const PluginInfo& a, const PluginInfo& b) {
      const int order_a = kind_order(a.kind);
      const int order_b = kind_order(b.kind);
      return std::tie(order_a, a.kind, a.name) < std::tie(order_b, b.kind, b.name);
    });
    if (parsed.has_flag("json")) {
      std::puts(to_json(rows, loader.search_path()).dump().c_str());
    } else {
      std::fputs(to_text(rows, loader.search_path()).c_str(), stdout);
    }
    return 0;
  } catch (const std::exception& error) {
    return report_error(error);
  }
}

}  // namespace meshrun::cli
