// meshrun train CONFIG.toml [--nproc-per-node N] [--hostfile FILE] [--nnodes N [--node-rank K]]
//               [--output DIR] [--timeout SECONDS] [key.path=value ...]
#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "errors.hpp"
#include "gemm_peak/gemm_peak.hpp"
#include "launch/launch.hpp"
#include "plan/plan.hpp"
#include "train/run.hpp"

namespace meshrun::cli {
namespace {

constexpr const char* kTrainUsage =
    "usage: meshrun train CONFIG.toml [--nproc-per-node N] [--hostfile FILE] "
    "[--nnodes N [--node-rank K]] [--output DIR] [--timeout SECONDS] [key.path=value ...]";

// The world the ranks will form: the launcher's when there is one (its size
// wins over the options), else the ranks this command starts: on every node
// of a hostfile without --nnodes.
int64_t expected_world_size(int64_t nproc_per_node, const launch::LaunchOptions& options) {
  const auto environment = launch::detect_launcher();
  if (environment && environment->size) return *environment->size;
  if (options.nnodes > 0) return nproc_per_node * options.nnodes;
  if (!options.hostfile.empty()) {
    return nproc_per_node * static_cast<int64_t>(launch::hostfile_hosts(options.hostfile).size());
  }
  return nproc_per_node;
}

}  // namespace

int run_train(const Args& args) {
  try {
    std::vector<OptionSpec> specs = launch_option_specs();
    specs.insert(specs.end(), {{"output", true}, {"help", false}});
    const ParsedArgs parsed = parse_args(args, specs, "train");
    if (parsed.has_flag("help")) {
      std::puts(kTrainUsage);
      return 0;
    }
    if (parsed.positionals.size() != 1) {
      throw invalid_argument("meshrun train: expected exactly one CONFIG.toml argument, got " +
                             std::to_string(parsed.positionals.size()));
    }
    const int nproc = ranks_per_node(parsed);
    const launch::LaunchOptions options = launch_options(parsed);
    const Config config = load_config(parsed.positionals[0], parsed.overrides);
    const train::GemmPeakMeter gemm_peak = train::gemm_peak_meter(config.dist_env.on_cuda());
    // Bad input fails here, once, before any rank starts.
    const PluginLoader loader = PluginLoader::from_environment();
    train::check_training_input(
        config, make_plan(config, expected_world_size(nproc, options), loader), nproc);
    if (!launch::detect_launcher() && started_from_node_zero(parsed)) return 0;

    if (auto status = relaunch_if_needed(nproc, "train", args, options)) return *status;
    if (!launch::detect_launcher()) launch::stop_job_on_interrupt();
    return train::train_rank(config, parsed.value("output"), gemm_peak);
  } catch (const std::exception& error) {
    return report_error(error);
  }
}

}  // namespace meshrun::cli
