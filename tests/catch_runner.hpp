// Catch2's runner, compiled once for every test program (catch_runner.cpp,
// the library meshrun_catch): the single-header Catch2 declares its Session
// only where it implements it.
#pragma once

namespace meshrun::testing {

// Runs the program's Catch2 tests over the command line `argv` (Catch2's
// options only); returns the exit status.
int run_catch_session(int argc, char** argv);

}  // namespace meshrun::testing
