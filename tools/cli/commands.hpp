// The `meshrun` subcommands. Each takes the arguments after its name and
// returns the process exit status: 0 success, 2 bad input (one message on
// stderr naming the key or argument), 1 any other failure.
#pragma once

#include <string>
#include <vector>

namespace meshrun::cli {

using Args = std::vector<std::string>;

int run_plan(const Args& args);
int run_plugins(const Args& args);
int run_bench(const Args& args);
int run_launch(const Args& args);
int run_train(const Args& args);
int run_schedule(const Args& args);
int run_trace(const Args& args);

}  // namespace meshrun::cli
