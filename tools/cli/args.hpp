// Command-line parsing shared by the subcommands: options (--name VALUE,
// --name=VALUE, --flag), positional arguments, and config overrides
// (key.path=value). Bad arguments throw meshrun::Error (INVALID_ARGUMENT).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli/commands.hpp"
#include "launch/launch.hpp"

namespace meshrun::cli {

struct OptionSpec {
  std::string name;  // without the leading "--"
  bool takes_value = false;
};

struct ParsedArgs {
  std::vector<std::string> positionals;
  std::vector<std::string> overrides;         // "key.path=value", in order
  std::map<std::string, std::string> values;  // options that take a value
  std::vector<std::string> flags;             // options that do not

  bool has_flag(std::string_view name) const;
  std::optional<std::string> value(std::string_view name) const;
};

ParsedArgs parse_args(const Args& args, const std::vector<OptionSpec>& spec,
                      std::string_view command);

// An integer option value in [minimum, maximum]; the error names the option.
int64_t parse_int_option(std::string_view option, const std::string& value, int64_t minimum,
                         int64_t maximum);

// --timeout SECONDS of `launch` and `train`: the limit on the whole job,
// 0 (none) when absent.
int job_timeout_seconds(const ParsedArgs& parsed);

// The options of `launch` and `train` that say where the ranks run:
// --nproc-per-node, --hostfile, --nnodes, --node-rank, --timeout.
const std::vector<OptionSpec>& launch_option_specs();
// --nproc-per-node N (1 when absent).
int ranks_per_node(const ParsedArgs& parsed);
// --hostfile, --nnodes and --timeout as launch options.
launch::LaunchOptions launch_options(const ParsedArgs& parsed);
// --node-rank K of a torchrun-style script that runs the same command on
// every node: true on nodes other than 0, after saying so on stderr, since
// there node 0's mpirun starts the ranks (MPI needs no rendezvous). Throws
// INVALID_ARGUMENT unless 0 <= K < --nnodes.
bool started_from_node_zero(const ParsedArgs& parsed);

// For `meshrun COMMAND ARGS` whose process is one rank: runs it as `nproc`
// ranks under mpirun unless already inside a launcher (see
// launch::relaunch_self_if_needed); returns the job's status when it did.
std::optional<int> relaunch_if_needed(int nproc, const std::string& command, const Args& args,
                                      const launch::LaunchOptions& options = {});

// Prints "meshrun: error: <message>" on stderr and returns the exit status
// for it: 2 for input errors, 1 otherwise.
int report_error(const std::exception& error);

}  // namespace meshrun::cli
