// Catch2's implementation, without a main (meshrun_catch).
#define CATCH_CONFIG_RUNNER
#include "catch_runner.hpp"

#include <catch2/catch.hpp>

namespace meshrun::testing {

int run_catch_session(int argc, char** argv) { return Catch::Session().run(argc, argv); }

}  // namespace meshrun::testing
