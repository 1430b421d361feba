// meshrun: the command-line front end. Dispatches to the subcommands of
// cli/commands.hpp.
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "errors.hpp"
#include "meshrun/error.h"
#include "plugin/call_scope.hpp"
#include "support/suggest.hpp"

namespace {

using Command = std::function<int(const meshrun::cli::Args&)>;

const std::map<std::string, Command>& commands() {
  static const std::map<std::string, Command> table = {
      {"plan", meshrun::cli::run_plan},   {"plugins", meshrun::cli::run_plugins},
      {"bench", meshrun::cli::run_bench}, {"launch", meshrun::cli::run_launch},
      {"train", meshrun::cli::run_train}, {"schedule", meshrun::cli::run_schedule},
      {"trace", meshrun::cli::run_trace},
  };
  return table;
}

std::vector<std::string> command_names() {
  std::vector<std::string> names;
  for (const auto& [name, command] : commands()) names.push_back(name);
  return names;
}

void print_usage() {
  std::puts(
      "usage: meshrun COMMAND [ARGS]\n"
      "  train CONFIG.toml [--nproc-per-node N] [--hostfile FILE] [--nnodes N [--node-rank K]]\n"
      "                   [--output DIR] [--timeout SECONDS] [key.path=value ...]\n"
      "                   train the model as N ranks; metrics and checkpoints in DIR\n"
      "  plan CONFIG.toml [--world-size N] [--json] [--all-ranks] [key.path=value ...]\n"
      "                   the mesh, plugins and rank layout a run would use\n"
      "  plugins [--kind strategy|schedule|sidecar|comm|model] [--json]\n"
      "                   the plugins on the search path (MESHRUN_PLUGIN_PATH adds folders)\n"
      "  schedule NAME --pp P --microbatches M [--stages-per-rank V] [--json] [--svg FILE]\n"
      "                   [--costs F=1,B=1,I=0.5,W=0.5]; --csv FILE in place of NAME reads one\n"
      "                   a pipeline schedule's actions, makespan, bubble and peak activations\n"
      "  launch --nproc-per-node N [--hostfile FILE] [--nnodes N [--node-rank K]]\n"
      "                   [--timeout SECONDS] -- COMMAND [ARGS...]\n"
      "                   run COMMAND as N ranks per node through mpirun\n"
      "  bench comm [--nproc N] [--ops ...] [--sizes ...] [--dtype D] [--json]\n"
      "                   collective bandwidth, checked against a local reference\n"
      "  bench memcpy [--sizes ...] [--json]\n"
      "                   single-core memcpy bandwidth, the ceiling for shared memory\n"
      "  bench peak [--threads N] [--dtype float32,bfloat16] [--json]\n"
      "                   GEMM FLOP/s on one thread per core, what metrics' mfu divides by\n"
      "  trace summary DIR [--json]\n"
      "                   per rank: compute, exposed comm and idle shares of a profiled run\n"
      "  --version        library and ABI version");
}

}  // namespace

int main(int argc, char** argv) {
  meshrun::install_plugin_crash_handler();
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    print_usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string name = argv[1];
  if (name == "--version") {
    std::printf("meshrun %s (ABI %d.%d)\n", MESHRUN_LIBRARY_VERSION, MESHRUN_ABI_VERSION_MAJOR,
                MESHRUN_ABI_VERSION_MINOR);
    return 0;
  }
  const auto command = commands().find(name);
  if (command == commands().end()) {
    return meshrun::cli::report_error(meshrun::invalid_argument(
        "unknown command '" + name + "'" + meshrun::did_you_mean(name, command_names()) +
        "; commands: " + meshrun::join_names(command_names())));
  }
  return command->second(meshrun::cli::Args(argv + 2, argv + argc));
}
