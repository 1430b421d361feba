// The main() of the unit tests: Catch2's runner over the command line.
#include "catch_runner.hpp"

int main(int argc, char** argv) { return meshrun::testing::run_catch_session(argc, argv); }
