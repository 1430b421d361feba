// meshrun plan CONFIG [--world-size N] [--json] [--all-ranks] [key.path=value ...]
#include <cstdio>
#include <limits>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "errors.hpp"
#include "plan/plan.hpp"

namespace meshrun::cli {

int run_plan(const Args& args) {
  try {
    const ParsedArgs parsed = parse_args(
        args, {{"world-size", true}, {"json", false}, {"all-ranks", false}, {"help", false}},
        "plan");
    if (parsed.has_flag("help")) {
      std::puts(
          "usage: meshrun plan CONFIG.toml [--world-size N] [--json] [--all-ranks] "
          "[key.path=value ...]");
      return 0;
    }
    if (parsed.positionals.size() != 1) {
      throw invalid_argument("meshrun plan: expected exactly one CONFIG.toml argument, got " +
                             std::to_string(parsed.positionals.size()));
    }
    const Config config = load_config(parsed.positionals[0], parsed.overrides);
    const auto world_option = parsed.value("world-size");
    const int64_t world_size = world_option ? parse_int_option("world-size", *world_option, 1,
                                                               std::numeric_limits<int32_t>::max())
                                            : default_world_size(config);
    const Plan plan = make_plan(config, world_size, PluginLoader::from_environment());
    const bool all_ranks = parsed.has_flag("all-ranks");
    if (parsed.has_flag("json")) {
      std::puts(plan_to_json(plan, all_ranks).dump().c_str());
    } else {
      std::fputs(plan_to_text(plan, all_ranks).c_str(), stdout);
    }
    return 0;
  } catch (const std::exception& error) {
    return report_error(error);
  }
}

}  // namespace meshrun::cli
