// meshrun train CONFIG.toml [--nproc-per-node N] [--output DIR] [--timeout SECONDS]
//               [key.path=value ...]
#include <cstdio>
#include <limits>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "errors.hpp"
#include "launch/launch.hpp"
#include "plan/plan.hpp"
#include "train/run.hpp"

namespace meshrun::cli {
namespace {

constexpr const char* kUsage =
    "usage: meshrun train CONFIG.toml [--nproc-per-node N] [--output DIR] [--timeout SECONDS] "
    "[key.path=value ...]";

// The world the ranks will form: the launcher's when there is one (its size
// wins over --nproc-per-node), else the ranks this command starts.
int64_t expected_world_size(int64_t nproc_per_node) {
  const auto environment = launch::detect_launcher();
  return environment && environment->size ? *environment->size : nproc_per_node;
}

}  // namespace

int run_train(const Args& args) {
  try {
    const ParsedArgs parsed = parse_args(
        args, {{"nproc-per-node", true}, {"output", true}, {"timeout", true}, {"help", false}},
        "train");
    if (parsed.has_flag("help")) {
      std::puts(kUsage);
      return 0;
    }
    if (parsed.positionals.size() != 1) {
      throw invalid_argument("meshrun train: expected exactly one CONFIG.toml argument, got " +
                             std::to_string(parsed.positionals.size()));
    }
    const int nproc = int(
        parse_int_option("nproc-per-node", parsed.value("nproc-per-node").value_or("1"), 1, 4096));
    launch::LaunchOptions options;
    options.timeout_seconds = job_timeout_seconds(parsed);
    const Config config = load_config(parsed.positionals[0], parsed.overrides);
    // Bad input fails here, once, before any rank starts.
    const PluginLoader loader = PluginLoader::from_environment();
    train::check_training_input(config, make_plan(config, expected_world_size(nproc), loader));

    if (auto status = relaunch_if_needed(nproc, "train", args, options)) return *status;
    if (!launch::detect_launcher()) launch::stop_job_on_interrupt();
    return train::train_rank(config, parsed.value("output"));
  } catch (const std::exception& error) {
    return report_error(error);
  }
}

}  // namespace meshrun::cli
