// meshrun trace summary DIR|trace.json [--json]: each rank's compute,
// exposed communication and idle shares of its training steps, from the
// Chrome trace a run with train.profile = true wrote.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "errors.hpp"
#include "trace/summary.hpp"

namespace meshrun::cli {
namespace {

constexpr const char* kTraceUsage =
    "usage: meshrun trace summary DIR|TRACE.json [--json]\n"
    "  DIR: a run's output folder, whose trace.json a run with train.profile = true wrote";

nlohmann::json read_trace(const std::string& where) {
  std::filesystem::path path(where);
  if (std::filesystem::is_directory(path)) path /= "trace.json";
  std::ifstream in(path);
  if (!in) {
    throw invalid_argument(
        fmt::format("{}: no such trace (a run writes DIR/trace.json with train.profile = true)",
                    path.string()));
  }
  const auto trace = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (trace.is_discarded()) {
    throw invalid_argument(fmt::format("{}: not JSON; expected a Chrome trace", path.string()));
  }
  return trace;
}

void print_shares(const std::vector<trace::RankShares>& shares, bool json) {
  if (!json)
    std::printf("%-6s %6s %10s %9s %9s %9s\n", "rank", "steps", "seconds", "compute", "comm",
                "idle");
  for (const trace::RankShares& s : shares) {
    if (json) {
      const nlohmann::ordered_json line = {{"rank", s.rank},       {"steps", s.steps},
                                           {"seconds", s.seconds}, {"compute", s.compute},
                                           {"comm", s.comm},       {"idle", s.idle}};
      std::puts(line.dump().c_str());
    } else {
      std::printf("%-6lld %6lld %10.3f %8.1f%% %8.1f%% %8.1f%%\n", static_cast<long long>(s.rank),
                  static_cast<long long>(s.steps), s.seconds, 100 * s.compute, 100 * s.comm,
                  100 * s.idle);
    }
  }
}

}  // namespace

int run_trace(const Args& args) {
  try {
    const ParsedArgs parsed = parse_args(args, {{"json", false}, {"help", false}}, "trace");
    if (parsed.has_flag("help")) {
      std::puts(kTraceUsage);
      return 0;
    }
    if (parsed.positionals.size() != 2 || parsed.positionals[0] != "summary") {
      throw invalid_argument("meshrun trace: expected 'summary DIR' (meshrun trace --help)");
    }
    std::vector<trace::RankShares> shares;
    try {
      shares = trace::summarize_trace(read_trace(parsed.positionals[1]));
    } catch (const std::invalid_argument& error) {
      throw invalid_argument(fmt::format("{}: {}", parsed.positionals[1], error.what()));
    } catch (const nlohmann::json::exception& error) {
      throw invalid_argument(fmt::format("{}: {}", parsed.positionals[1], error.what()));
    }
    print_shares(shares, parsed.has_flag("json"));
    return 0;
  } catch (const std::exception& error) {
    return report_error(error);
  }
}

}  // namespace meshrun::cli
