#include "launch/launch.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "errors.hpp"
#include "launch/mpirun.hpp"

namespace meshrun::launch {
namespace {

// Where one kind of launcher keeps rank, size and local rank. Lists are
// tried in order; `markers`, when given, must have one variable set.
struct LauncherVariables {
  const char* launcher;
  const char* rank;
  std::vector<const char*> size;
  std::vector<const char*> local_rank;
  std::vector<const char*> markers;
};

const std::vector<LauncherVariables>& known_launchers() {
  static const std::vector<LauncherVariables> launchers = {
      {"openmpi",
       "OMPI_COMM_WORLD_RANK",
       {"OMPI_COMM_WORLD_SIZE"},
       {"OMPI_COMM_WORLD_LOCAL_RANK"},
       {}},
      // An sbatch script sees SLURM_PROCID and SLURM_NTASKS of the whole
      // allocation without being a rank; only srun's job steps set a step id.
      {"slurm",
       "SLURM_PROCID",
       {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"},
       {"SLURM_LOCALID"},
       {"SLURM_STEP_ID", "SLURM_STEPID"}},
      {"pmi", "PMI_RANK", {"PMI_SIZE"}, {"MPI_LOCALRANKID"}, {}},
      {"pmix", "PMIX_RANK", {}, {}, {}},
  };
  return launchers;
}

std::optional<int64_t> read_count(const GetEnv& getenv, const char* name) {
  const char* value = getenv(name);
  if (value == nullptr) return std::nullopt;
  int64_t parsed = -1;
  const char* end = value + std::strlen(value);
  const auto [stop, error] = std::from_chars(value, end, parsed);
  if (error != std::errc() || stop != end || parsed < 0) return std::nullopt;
  return parsed;
}

std::optional<int64_t> read_first(const GetEnv& getenv, const std::vector<const char*>& names) {
  for (const char* name : names) {
    if (auto value = read_count(getenv, name)) return value;
  }
  return std::nullopt;
}

bool any_set(const GetEnv& getenv, const std::vector<const char*>& names) {
  for (const char* name : names) {
    if (getenv(name) != nullptr) return true;
  }
  return names.empty();
}

// Without a hostfile, --nnodes above 1 takes the nodes of the Slurm
// allocation this process runs in.
void check_allocation(int nnodes) {
  const char* allocated = std::getenv("SLURM_JOB_NUM_NODES");
  if (allocated == nullptr) allocated = std::getenv("SLURM_NNODES");
  if (allocated == nullptr) {
    throw invalid_argument(fmt::format(
        "--nnodes {}: name the nodes with --hostfile FILE, or run inside a Slurm allocation "
        "(sbatch, salloc), or start the ranks with srun",
        nnodes));
  }
  if (std::atoi(allocated) < nnodes) {
    throw invalid_argument(fmt::format("--nnodes {}: the Slurm allocation has {} node{}", nnodes,
                                       allocated, std::string(allocated) == "1" ? "" : "s"));
  }
}

void check_command(const std::vector<std::string>& command, const LaunchOptions& options) {
  if (command.empty()) throw invalid_argument("no command to launch");
  // With a hostfile the command need only exist on the other nodes.
  if (options.hostfile.empty() && !find_on_path(command[0])) {
    throw Error(MESHRUN_NOT_FOUND,
                fmt::format("cannot run '{}': {}", command[0],
                            command[0].find('/') == std::string::npos ? "no such command on PATH"
                                                                      : "no such executable file"));
  }
}

void check_options(int nproc_per_node, const LaunchOptions& options) {
  if (nproc_per_node < 1) {
    throw invalid_argument(
        fmt::format("the number of ranks per node must be at least 1, got {}", nproc_per_node));
  }
  if (options.timeout_seconds < 0) {
    throw invalid_argument(fmt::format("the job timeout must be 0 (none) or more seconds, got {}",
                                       options.timeout_seconds));
  }
  if (options.nnodes < 0) {
    throw invalid_argument(
        fmt::format("the number of nodes must be at least 1, got {}", options.nnodes));
  }
  if (!options.hostfile.empty()) {
    const auto hosts = hostfile_hosts(options.hostfile);
    if (hosts.size() < static_cast<size_t>(std::max(options.nnodes, 1))) {
      throw invalid_argument(fmt::format("--nnodes {}: the hostfile '{}' names {} host{} ({})",
                                         options.nnodes, options.hostfile, hosts.size(),
                                         hosts.size() == 1 ? "" : "s", fmt::join(hosts, ", ")));
    }
  } else if (options.nnodes > 1) {
    check_allocation(options.nnodes);
  }
}

}  // namespace

std::vector<std::string> hostfile_hosts(const std::string& hostfile) {
  std::ifstream file(hostfile);
  if (!file) {
    throw Error(MESHRUN_NOT_FOUND,
                fmt::format("cannot read hostfile '{}': {}", hostfile, std::strerror(errno)));
  }
  std::vector<std::string> hosts;
  std::string line;
  while (std::getline(file, line)) {
    std::istringstream words(line);
    std::string host;
    if (!(words >> host) || host[0] == '#') continue;
    if (std::find(hosts.begin(), hosts.end(), host) == hosts.end()) hosts.push_back(host);
  }
  return hosts;
}

std::optional<LaunchEnvironment> detect_launcher(const GetEnv& getenv) {
  for (const LauncherVariables& variables : known_launchers()) {
    const auto rank = read_count(getenv, variables.rank);
    if (!rank || !any_set(getenv, variables.markers)) continue;
    return LaunchEnvironment{variables.launcher, *rank, read_first(getenv, variables.size),
                             read_first(getenv, variables.local_rank)};
  }
  return std::nullopt;
}

std::optional<LaunchEnvironment> detect_launcher() {
  return detect_launcher([](const char* name) -> const char* { return std::getenv(name); });
}

int launch_local(int nproc_per_node, const std::vector<std::string>& command,
                 const LaunchOptions& options) {
  check_options(nproc_per_node, options);
  check_command(command, options);
  prefer_fast_blas_kernels();
  const SessionDirectory session;
  HostFacts facts = host_facts();
  facts.session_base = session.path();
  return run_mpirun(mpirun_command(nproc_per_node, command, options, facts), options);
}

bool prefer_fast_blas_kernels() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return false;
  __builtin_cpu_init();
  const char* kernels = __builtin_cpu_supports("avx512f") ? "SkylakeX"
                        : __builtin_cpu_supports("avx2")  ? "Haswell"
                                                          : nullptr;
  return kernels != nullptr && setenv("OPENBLAS_CORETYPE", kernels, 0) == 0;
}

namespace {

std::filesystem::path this_executable() {
  std::error_code error;
  std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) {
    throw Error(MESHRUN_INTERNAL,
                fmt::format("cannot find this executable (/proc/self/exe): {}", error.message()));
  }
  return self;
}

// Runs this executable again with the same arguments, in this process, so
// that libraries read the environment afresh. Returns only if exec fails.
void exec_self(int argc, char** argv) {
  std::fflush(nullptr);
  std::vector<char*> args(argv, argv + argc);
  args.push_back(nullptr);
  execv(this_executable().c_str(), args.data());
}

}  // namespace

std::optional<int> relaunch_self_if_needed(int nproc_per_node, int argc, char** argv,
                                           const LaunchOptions& options) {
  if (detect_launcher()) return std::nullopt;
  if (nproc_per_node == 1 && !options.spans_nodes() && options.timeout_seconds == 0) {
    // The only rank is this process: it needs a fresh start to load OpenBLAS
    // with the kernels chosen (a failed exec just keeps the default ones).
    if (prefer_fast_blas_kernels()) exec_self(argc, argv);
    return std::nullopt;
  }
  std::vector<std::string> command = {this_executable().string()};
  command.insert(command.end(), argv + std::min(argc, 1), argv + argc);
  return launch_local(nproc_per_node, command, options);
}

std::string interrupted_message(int signal) {
  return fmt::format("interrupted by SIG{}; the job was stopped", sigabbrev_np(signal));
}

namespace {

// The handler's lines, made before it is installed: it may only write them.
std::string interrupted_lines[2];  // SIGINT, SIGTERM

void end_interrupted_job(int signal) {
  const std::string& line = interrupted_lines[signal == SIGINT ? 0 : 1];
  // Should stderr be gone, the status still says it.
  [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, line.data(), line.size());
  _exit(128 + signal);
}

}  // namespace

void stop_job_on_interrupt() {
  int slot = 0;
  for (const int signal : {SIGINT, SIGTERM}) {
    interrupted_lines[slot++] = "meshrun: error: " + interrupted_message(signal) + "\n";
    struct sigaction action = {};
    action.sa_handler = end_interrupted_job;
    sigemptyset(&action.sa_mask);
    sigaction(signal, &action, nullptr);
  }
}

void abort_rank(int64_t rank, const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "meshrun: error: rank %lld: %s\n", static_cast<long long>(rank),
               message.c_str());
  std::fflush(stderr);
  std::_Exit(3);
}

}  // namespace meshrun::launch
