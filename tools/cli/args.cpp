#include "cli/args.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>

#include "errors.hpp"
#include "launch/launch.hpp"
#include "support/suggest.hpp"

namespace meshrun::cli {
namespace {

bool is_override(const std::string& arg) {
  const auto equals = arg.find('=');
  if (equals == std::string::npos || equals == 0 || arg[0] == '-') return false;
  return std::all_of(arg.begin(), arg.begin() + static_cast<std::ptrdiff_t>(equals), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
  });
}

const OptionSpec& find_option(const std::vector<OptionSpec>& spec, const std::string& name,
                              std::string_view command) {
  for (const auto& option : spec) {
    if (option.name == name) return option;
  }
  std::vector<std::string> names;
  for (const auto& option : spec) names.push_back(option.name);
  std::vector<std::string> dashed;
  for (const auto& option : spec) dashed.push_back("--" + option.name);
  throw invalid_argument(fmt::format("meshrun {}: unknown option '--{}'{}; valid options: {}",
                                     command, name, did_you_mean(name, names), join_names(dashed)));
}

}  // namespace

bool ParsedArgs::has_flag(std::string_view name) const {
  return std::find(flags.begin(), flags.end(), name) != flags.end();
}

std::optional<std::string> ParsedArgs::value(std::string_view name) const {
  const auto found = values.find(std::string(name));
  if (found == values.end()) return std::nullopt;
  return found->second;
}

ParsedArgs parse_args(const Args& args, const std::vector<OptionSpec>& spec,
                      std::string_view command) {
  ParsedArgs parsed;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0 || arg == "--") {
      (is_override(arg) ? parsed.overrides : parsed.positionals).push_back(arg);
      continue;
    }
    std::string name = arg.substr(2);
    std::optional<std::string> inline_value;
    if (const auto equals = name.find('='); equals != std::string::npos) {
      inline_value = name.substr(equals + 1);
      name.resize(equals);
    }
    const OptionSpec& option = find_option(spec, name, command);
    if (!option.takes_value) {
      if (inline_value) {
        throw invalid_argument(
            fmt::format("meshrun {}: option '--{}' takes no value", command, name));
      }
      parsed.flags.push_back(name);
    } else if (inline_value) {
      parsed.values[name] = *inline_value;
    } else if (i + 1 < args.size()) {
      parsed.values[name] = args[++i];
    } else {
      throw invalid_argument(fmt::format("meshrun {}: option '--{}' needs a value", command, name));
    }
  }
  return parsed;
}

int64_t parse_int_option(std::string_view option, const std::string& value, int64_t minimum,
                         int64_t maximum) {
  int64_t parsed = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), parsed);
  if (error != std::errc() || end != value.data() + value.size() || parsed < minimum ||
      parsed > maximum) {
    throw invalid_argument(fmt::format("option '--{}': expected an integer in [{}, {}], got '{}'",
                                       option, minimum, maximum, value));
  }
  return parsed;
}

int job_timeout_seconds(const ParsedArgs& parsed) {
  const auto timeout = parsed.value("timeout");
  if (!timeout) return 0;
  return static_cast<int>(
      parse_int_option("timeout", *timeout, 0, std::numeric_limits<int>::max()));
}

const std::vector<OptionSpec>& launch_option_specs() {
  static const std::vector<OptionSpec> specs = {{"nproc-per-node", true},
                                                {"hostfile", true},
                                                {"nnodes", true},
                                                {"node-rank", true},
                                                {"timeout", true}};
  return specs;
}

int ranks_per_node(const ParsedArgs& parsed) {
  return static_cast<int>(
      parse_int_option("nproc-per-node", parsed.value("nproc-per-node").value_or("1"), 1, 4096));
}

launch::LaunchOptions launch_options(const ParsedArgs& parsed) {
  launch::LaunchOptions options;
  options.hostfile = parsed.value("hostfile").value_or("");
  if (const auto nnodes = parsed.value("nnodes")) {
    options.nnodes = static_cast<int>(parse_int_option("nnodes", *nnodes, 1, 65536));
  }
  options.timeout_seconds = job_timeout_seconds(parsed);
  return options;
}

bool started_from_node_zero(const ParsedArgs& parsed) {
  const auto node_rank = parsed.value("node-rank");
  if (!node_rank) return false;
  const auto nnodes = parsed.value("nnodes");
  if (!nnodes) {
    throw invalid_argument("option '--node-rank' needs '--nnodes N', the number of nodes");
  }
  const int64_t nodes = parse_int_option("nnodes", *nnodes, 1, 65536);
  const int64_t rank = parse_int_option("node-rank", *node_rank, 0, nodes - 1);
  if (rank == 0) return false;
  std::fprintf(stderr,
               "meshrun: node rank %lld of %lld: nothing to start here; the command on node "
               "rank 0 starts every node's ranks through mpirun (--hostfile or the Slurm "
               "allocation)\n",
               static_cast<long long>(rank), static_cast<long long>(nodes));
  return true;
}

std::optional<int> relaunch_if_needed(int nproc, const std::string& command, const Args& args,
                                      const launch::LaunchOptions& options) {
  std::vector<std::string> full = {"meshrun", command};
  full.insert(full.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& arg : full) argv.push_back(arg.data());
  argv.push_back(nullptr);
  return launch::relaunch_self_if_needed(nproc, static_cast<int>(full.size()), argv.data(),
                                         options);
}

int report_error(const std::exception& error) {
  std::fprintf(stderr, "meshrun: error: %s\n", error.what());
  const auto* meshrun_error = dynamic_cast<const Error*>(&error);
  return meshrun_error != nullptr && meshrun_error->is_input_error() ? 2 : 1;
}

}  // namespace meshrun::cli
