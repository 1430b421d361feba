// One rank of the jobs test_launch.py starts through `meshrun launch`.
//
//   rank-program env            print what the launcher told this rank
//   rank-program relaunch N     start itself as N ranks through
//                               relaunch_self_if_needed, each one as `env`
//   rank-program exit R CODE    rank R exits with CODE, the others wait
//   rank-program kill R         rank R kills itself with SIGKILL, the others wait
//   rank-program abort R        rank R gives up through launch::abort_rank
//   rank-program hang R         rank R waits, the others finish
//   rank-program wait MARKER    every rank waits (MARKER finds them in ps)
//   rank-program comm R T       every rank all-reduces in a loop through the
//                               mpi comm backend (wait timeout T s); rank R
//                               kills itself with SIGKILL in the middle
//   rank-program stall R T      the same, but rank R stops taking part and
//                               waits: the others' waits time out
//
// "Wait" is 30 s: far longer than the tests allow, so a test passes only
// when mpirun ends the waiting ranks.
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.hpp"
#include "launch/launch.hpp"
#include "plugin/loader.hpp"

namespace {

using meshrun::launch::LaunchEnvironment;

void wait_long() { std::this_thread::sleep_for(std::chrono::seconds(30)); }

std::string optional_text(const std::optional<int64_t>& value) {
  return value ? std::to_string(*value) : "unknown";
}

int print_environment(const std::optional<LaunchEnvironment>& launcher) {
  if (!launcher) {
    std::puts("no launcher");
    return 0;
  }
  const char* variable = std::getenv("MESHRUN_TEST_VALUE");
  std::printf("rank %lld of %s local %s launcher %s value %s\n",
              static_cast<long long>(launcher->rank), optional_text(launcher->size).c_str(),
              optional_text(launcher->local_rank).c_str(), launcher->launcher.c_str(),
              variable != nullptr ? variable : "unset");
  std::fprintf(stderr, "stderr of rank %lld\n", static_cast<long long>(launcher->rank));
  return 0;
}

int relaunch(int argc, char** argv) {
  if (const auto status =
          meshrun::launch::relaunch_self_if_needed(std::stoi(argv[2]), argc, argv)) {
    return *status;
  }
  return print_environment(meshrun::launch::detect_launcher());
}

void kill_self() {
  std::fflush(stdout);
  kill(getpid(), SIGKILL);
}

// All-reduces 1 MiB of floats for at most 30 s; at step 20 `victim` kills
// itself or (`stall`) stops taking part. A comm error (a timeout, a peer
// gone) ends this rank through abort_rank.
int all_reduce_until_failure(int64_t victim, bool stall, double timeout_seconds) {
  meshrun::CommBackend backend(meshrun::PluginLoader::from_environment(), "mpi");
  meshrun::Communicator world = backend.world(timeout_seconds);
  std::vector<float> values(1 << 18, 1.0f);
  meshrun::FlatTensor tensor(values.data(), meshrun::dtype_float32(),
                             static_cast<int64_t>(values.size()));
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (int step = 0; std::chrono::steady_clock::now() < end; ++step) {
    if (world.rank() == victim && step == 20) stall ? wait_long() : kill_self();
    try {
      world.all_reduce(tensor.get(), meshrun::ReduceOp::avg).wait();
    } catch (const std::exception& error) {
      meshrun::launch::abort_rank(world.rank(), error.what());
    }
  }
  return 0;
}

int run(const std::vector<std::string>& args, int64_t rank) {
  const std::string& mode = args.at(0);
  const auto chosen = [&] { return std::stoll(args.at(1)) == rank; };
  if (mode == "exit" && chosen()) return std::stoi(args.at(2));
  if (mode == "kill" && chosen()) kill_self();
  if (mode == "abort" && chosen()) meshrun::launch::abort_rank(rank, "simulated comm failure");
  if (mode == "comm" || mode == "stall") {
    return all_reduce_until_failure(std::stoll(args.at(1)), mode == "stall", std::stod(args.at(2)));
  }
  if (mode == "hang" && !chosen()) return 0;
  wait_long();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  const auto launcher = meshrun::launch::detect_launcher();
  if (args.empty() || args[0] == "env") return print_environment(launcher);
  if (args[0] == "relaunch" && args.size() == 2) return relaunch(argc, argv);
  // Give every rank time to start, so mpirun's report is about a running job.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  return run(args, launcher ? launcher->rank : 0);
}
