// meshrun launch --nproc-per-node N [--hostfile FILE] [--nnodes N [--node-rank K]]
//                [--timeout SECONDS] -- COMMAND [ARGS...]
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "errors.hpp"
#include "launch/launch.hpp"

namespace meshrun::cli {
namespace {

constexpr const char* kLaunchUsage =
    "usage: meshrun launch --nproc-per-node N [--hostfile FILE] [--nnodes N [--node-rank K]] "
    "[--timeout SECONDS] -- COMMAND [ARGS...]";

// Under a launcher this process already is one rank of a job: it becomes
// the command instead of starting ranks of its own.
[[noreturn]] void run_in_place(const std::vector<std::string>& command) {
  launch::prefer_fast_blas_kernels();
  std::vector<char*> argv;
  for (const std::string& arg : command) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  throw Error(MESHRUN_NOT_FOUND,
              "meshrun launch: cannot run '" + command[0] + "': " + std::strerror(errno));
}

}  // namespace

int run_launch(const Args& args) {
  try {
    const auto separator = std::find(args.begin(), args.end(), "--");
    std::vector<OptionSpec> specs = launch_option_specs();
    specs.push_back({"help", false});
    const ParsedArgs parsed = parse_args(Args(args.begin(), separator), specs, "launch");
    if (parsed.has_flag("help")) {
      std::puts(kLaunchUsage);
      return 0;
    }
    if (!parsed.positionals.empty() || !parsed.overrides.empty()) {
      const std::string& extra =
          parsed.positionals.empty() ? parsed.overrides[0] : parsed.positionals[0];
      throw invalid_argument("meshrun launch: unexpected argument '" + extra + "' before '--'; " +
                             kLaunchUsage);
    }
    const auto nproc = parsed.value("nproc-per-node");
    if (!nproc)
      throw invalid_argument("meshrun launch: --nproc-per-node N is required; " +
                             std::string(kLaunchUsage));
    const int nproc_per_node = ranks_per_node(parsed);
    if (separator == args.end() || separator + 1 == args.end()) {
      throw invalid_argument("meshrun launch: expected '-- COMMAND [ARGS...]' after the options; " +
                             std::string(kLaunchUsage));
    }
    const std::vector<std::string> command(separator + 1, args.end());
    const launch::LaunchOptions options = launch_options(parsed);
    if (launch::detect_launcher()) run_in_place(command);
    if (started_from_node_zero(parsed)) return 0;
    return launch::launch_local(nproc_per_node, command, options);
  } catch (const std::exception& error) {
    return report_error(error);
  }
}

}  // namespace meshrun::cli
