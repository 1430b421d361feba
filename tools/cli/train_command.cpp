// meshrun train CONFIG.toml [--nproc-per-node N] [--hostfile FILE] [--nnodes N [--node-rank K]]
//               [--output DIR] [--timeout SECONDS] [key.path=value ...]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include <fmt/format.h>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "errors.hpp"
#include "launch/launch.hpp"
#include "mesh/device.hpp"
#include "numeric/peak.hpp"
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

constexpr const char* kStatedPeakVariable = "MESHRUN_GEMM_PEAK_FLOPS";

// MESHRUN_GEMM_PEAK_FLOPS="float32=1.2e11,bfloat16=2.4e11": one rank's GEMM
// peak in FLOP/s per matmul dtype, stated instead of measured at the start
// of the run (0.1 s per run): a datasheet figure, or `meshrun bench peak`'s
// on a quiet machine, so that MFU compares across runs on a busy one. A
// dtype it does not name, or an empty variable, is measured. Throws INVALID_ARGUMENT naming the
// variable and the entry.
std::map<std::string, double> stated_gemm_peaks() {
  std::map<std::string, double> peaks;
  const char* value = std::getenv(kStatedPeakVariable);
  if (value == nullptr || *value == '\0') return peaks;
  const std::string text = value;
  size_t start = 0;
  for (int position = 1; start <= text.size(); ++position) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string entry = text.substr(start, comma - start);
    start = comma + 1;
    const size_t equals = entry.find('=');
    const std::string dtype = entry.substr(0, equals);
    char* end = nullptr;
    const double flops =
        equals == std::string::npos ? 0 : std::strtod(entry.c_str() + equals + 1, &end);
    const bool number = end != nullptr && end != entry.c_str() + equals + 1 && *end == '\0';
    if ((dtype != "float32" && dtype != "bfloat16") || !number || !std::isfinite(flops) ||
        flops <= 0 || peaks.contains(dtype)) {
      throw invalid_argument(fmt::format(
          "{}: entry {} \"{}\": expected DTYPE=FLOPS with DTYPE float32 or bfloat16 (each at "
          "most once) and FLOPS a positive number, one rank's GEMM peak, e.g. "
          "\"float32=1.2e11,bfloat16=2.4e11\"",
          kStatedPeakVariable, position, entry));
    }
    peaks[dtype] = flops;
  }
  return peaks;
}

train::GemmPeakMeter gemm_peak_meter() {
  return [stated = stated_gemm_peaks()](const std::string& dtype, double seconds) {
    const auto found = stated.find(dtype);
    if (found != stated.end()) return train::GemmPeak{found->second, kStatedPeakVariable};
    return train::GemmPeak{gemm_flops_per_s(dtype, seconds), "measured"};
  };
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
    const train::GemmPeakMeter gemm_peak = gemm_peak_meter();
    // Bad input fails here, once, before any rank starts.
    const PluginLoader loader = PluginLoader::from_environment();
    train::check_training_input(config,
                                make_plan(config, expected_world_size(nproc, options), loader));
    require_usable_devices(config, cuda_devices());
    if (!launch::detect_launcher() && started_from_node_zero(parsed)) return 0;

    if (auto status = relaunch_if_needed(nproc, "train", args, options)) return *status;
    if (!launch::detect_launcher()) launch::stop_job_on_interrupt();
    return train::train_rank(config, parsed.value("output"), gemm_peak);
  } catch (const std::exception& error) {
    return report_error(error);
  }
}

}  // namespace meshrun::cli
