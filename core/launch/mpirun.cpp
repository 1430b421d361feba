#include "launch/mpirun.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "errors.hpp"
#include "launch/mpirun_output.hpp"

extern char** environ;

namespace meshrun::launch {
namespace {

using Clock = std::chrono::steady_clock;

// Read by the signal handler: which process to pass SIGINT/SIGTERM on to,
// and the last such signal, so the final report can say the job was
// interrupted.
std::atomic<pid_t> forward_to{0};
volatile std::sig_atomic_t interrupted_by = 0;

void forward_signal(int signal, siginfo_t* info, void*) {
  interrupted_by = signal;
  // Ctrl-C at a terminal (SI_KERNEL) already reached mpirun: it is in our
  // process group. Passing it on again would make mpirun abort harder.
  if (info->si_code == SI_KERNEL) return;
  const pid_t pid = forward_to.load();
  if (pid > 0) kill(pid, signal);
}

// Forwards SIGINT and SIGTERM to mpirun, and ignores SIGPIPE so that a
// closed stdout (`meshrun launch ... | head`) does not kill the launcher
// while mpirun runs; restores the previous actions.
class SignalForwarding {
 public:
  SignalForwarding() {
    struct sigaction action = {};
    action.sa_sigaction = forward_signal;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &saved_[0]);
    sigaction(SIGTERM, &action, &saved_[1]);
    struct sigaction ignore = {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ignore, &saved_[2]);
    interrupted_by = 0;
  }
  ~SignalForwarding() {
    sigaction(SIGINT, &saved_[0], nullptr);
    sigaction(SIGTERM, &saved_[1], nullptr);
    sigaction(SIGPIPE, &saved_[2], nullptr);
    forward_to = 0;
  }
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

 private:
  std::array<struct sigaction, 3> saved_ = {};
};

struct Child {
  pid_t pid = 0;
  int out = -1;  // read ends of mpirun's stdout and stderr
  int err = -1;
};

// Starts `argv` with its stdout and stderr on `out` and `err`.
pid_t start_process(const std::vector<std::string>& argv, int out, int err) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err, STDERR_FILENO);
  // SIGPIPE is ignored here while the job runs; the ranks should not be.
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);
  posix_spawnattr_setsigdefault(&attributes, &defaults);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int status = posix_spawn(&pid, args[0], &actions, &attributes, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  if (status != 0) {
    throw Error(MESHRUN_INTERNAL,
                fmt::format("cannot start {}: {}", argv[0], std::strerror(status)));
  }
  return pid;
}

Child spawn(const std::vector<std::string>& argv) {
  int out[2] = {-1, -1};
  int err[2] = {-1, -1};
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
    const int error = errno;
    for (int fd : {out[0], out[1]}) close(fd);
    throw Error(MESHRUN_INTERNAL, fmt::format("cannot create pipes: {}", std::strerror(error)));
  }
  Child child{0, out[0], err[0]};
  try {
    child.pid = start_process(argv, out[1], err[1]);
  } catch (...) {
    for (int fd : {out[0], out[1], err[0], err[1]}) close(fd);
    throw;
  }
  // Only mpirun writes to the pipes: end of file comes when it is done.
  close(out[1]);
  close(err[1]);
  return child;
}

void write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t written = write(fd, text.data(), text.size());
    if (written < 0 && errno == EINTR) continue;
    // Nowhere left to show it (stdout closed): keep relaying the rest.
    if (written <= 0) return;
    text.remove_prefix(static_cast<size_t>(written));
  }
}

void write_line(OutputStream stream, const std::string& line) {
  write_all(stream == OutputStream::out ? STDOUT_FILENO : STDERR_FILENO, line + '\n');
}

void print_error(const std::string& message) {
  write_line(OutputStream::err, "meshrun: error: " + message);
}

// One of mpirun's pipes and what has been made of it so far.
struct Channel {
  Channel(int fd, OutputStream stream) : fd(fd), stream(stream), decoder(stream) {}

  int fd;
  OutputStream stream;
  TaggedOutputDecoder decoder;
  MpirunMessages messages;

  void show(const std::vector<OutputLine>& lines) {
    for (const OutputLine& line : lines) {
      if (line.rank) {
        write_line(line.stream, rank_line(*line.rank, line.text));
        continue;
      }
      for (const std::string& shown : messages.add(line.text)) write_line(line.stream, shown);
    }
  }

  // Relays what is available; false once the pipe is closed.
  bool read_some() {
    char buffer[65536];
    const ssize_t got = read(fd, buffer, sizeof buffer);
    if (got < 0) return errno == EINTR || errno == EAGAIN;
    if (got == 0) {
      close();
      return false;
    }
    show(decoder.feed(std::string_view(buffer, static_cast<size_t>(got))));
    return true;
  }

  void close() {
    if (fd < 0) return;
    ::close(fd);
    fd = -1;
    show(decoder.finish());
    for (const std::string& shown : messages.finish()) write_line(stream, shown);
  }
};

// The launcher's own limit, in case mpirun's --timeout does not end the
// job: SIGTERM a while after the job's limit, SIGKILL if that is ignored.
class Backstop {
 public:
  explicit Backstop(int timeout_seconds)
      : enabled_(timeout_seconds > 0),
        terminate_at_(Clock::now() + std::chrono::seconds(int64_t{timeout_seconds} + 30)) {}

  void check(pid_t pid) {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (!fired_ && now >= terminate_at_) {
      fired_ = true;
      kill(pid, SIGTERM);
    } else if (fired_ && now >= terminate_at_ + std::chrono::seconds(10)) {
      kill(pid, SIGKILL);
    }
  }
  bool fired() const { return fired_; }

 private:
  bool enabled_;
  Clock::time_point terminate_at_;
  bool fired_ = false;
};

bool reaped(pid_t pid, int options, int& status) {
  pid_t result;
  do {
    result = waitpid(pid, &status, options);
  } while (result < 0 && errno == EINTR);
  return result == pid;
}

// Relays both pipes until mpirun has exited and its output is drained.
// Returns mpirun's wait status.
int relay(const Child& child, std::array<Channel, 2>& channels, Backstop& backstop) {
  int status = 0;
  bool exited = false;
  while (channels[0].fd >= 0 || channels[1].fd >= 0) {
    std::array<pollfd, 2> fds = {};
    for (size_t i = 0; i < channels.size(); ++i) fds[i] = {channels[i].fd, POLLIN, 0};
    const int ready = poll(fds.data(), fds.size(), 200);
    for (size_t i = 0; i < channels.size(); ++i) {
      if (fds[i].fd >= 0 && fds[i].revents != 0) channels[i].read_some();
    }
    if (!exited) exited = reaped(child.pid, WNOHANG, status);
    // A rank's own child may still hold the pipes open after mpirun ended.
    if (exited && ready == 0) break;
    backstop.check(child.pid);
  }
  for (Channel& channel : channels) channel.close();
  if (!exited) reaped(child.pid, 0, status);
  return status;
}

bool verbose() {
  const char* value = std::getenv("MESHRUN_LAUNCH_VERBOSE");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

// The one line (and status) that ends a launch.
int report(int wait_status, const std::string& held, const LaunchOptions& options,
           bool backstop_fired) {
  const bool show_all = verbose();
  if (show_all) write_all(STDERR_FILENO, held);
  if (const auto failure = summarize_mpirun_messages(held, options.spans_nodes())) {
    print_error(failure->message);
    return failure->exit_status;
  }
  if (backstop_fired) {
    print_error(fmt::format("the job timed out after {} s; mpirun did not stop it and was killed",
                            options.timeout_seconds));
    return 124;
  }
  if (interrupted_by != 0) {
    print_error(interrupted_message(interrupted_by));
    return 128 + interrupted_by;
  }
  const int status =
      WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : 128 + WTERMSIG(wait_status);
  if (!show_all) write_all(STDERR_FILENO, held);
  if (status != 0) print_error(fmt::format("mpirun exited with status {}", status));
  return status;
}

std::vector<std::string> meshrun_variables() {
  std::vector<std::string> names;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view variable(*entry);
    const size_t equals = variable.find('=');
    const bool ours = variable.rfind("MESHRUN_", 0) == 0 || variable.rfind("OPENBLAS_", 0) == 0;
    if (ours && equals != std::string_view::npos) {
      names.emplace_back(variable.substr(0, equals));
    }
  }
  return names;
}

bool transport_chosen() {
  for (const char* name : {"OMPI_MCA_pml", "OMPI_MCA_btl", "OMPI_MCA_mtl"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

int cpu_count() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

std::optional<std::string> find_on_path(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    return access(name.c_str(), X_OK) == 0 ? std::optional<std::string>(name) : std::nullopt;
  }
  const char* path = std::getenv("PATH");
  std::string_view dirs = path != nullptr ? path : "";
  while (!dirs.empty()) {
    const size_t colon = std::min(dirs.find(':'), dirs.size());
    std::string candidate = std::string(dirs.substr(0, colon));
    candidate = (candidate.empty() ? "." : candidate) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    dirs.remove_prefix(std::min(colon + 1, dirs.size()));
  }
  return std::nullopt;
}

SessionDirectory::SessionDirectory() {
  const char* tmpdir = std::getenv("TMPDIR");
  std::string pattern = std::string(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp") +
                        "/meshrun-session-XXXXXX";
  if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
}

SessionDirectory::~SessionDirectory() {
  if (path_.empty()) return;
  std::error_code ignored;  // what cannot be removed stays, as Open MPI's own would
  std::filesystem::remove_all(path_, ignored);
}

HostFacts host_facts() {
  const auto mpirun = find_on_path("mpirun");
  if (!mpirun) {
    throw Error(MESHRUN_NOT_FOUND,
                "mpirun not found on PATH: meshrun starts ranks through Open MPI's mpirun; "
                "install the Debian package openmpi-bin");
  }
  return {*mpirun, geteuid() == 0, cpu_count(), meshrun_variables(), transport_chosen(), {}};
}

std::vector<std::string> mpirun_command(int nproc_per_node, const std::vector<std::string>& command,
                                        const LaunchOptions& options, const HostFacts& facts) {
  std::vector<std::string> argv = {facts.mpirun, "--tag-output", "--bind-to", "none"};
  if (facts.root) argv.emplace_back("--allow-run-as-root");
  if (!options.spans_nodes()) {
    // Slots are then hardware threads, as `cpus` counts them, rather than
    // Open MPI's default of physical cores.
    argv.insert(argv.end(), {"--use-hwthread-cpus", "-np", std::to_string(nproc_per_node)});
    if (nproc_per_node > facts.cpus) argv.emplace_back("--oversubscribe");
    // Ranks of one node talk through shared memory; naming it spares every
    // start probing the network transports (UCX, OFI), 0.2 s of each run.
    if (!facts.transport_chosen) {
      argv.insert(argv.end(), {"--mca", "pml", "ob1", "--mca", "btl", "self,vader"});
    }
    if (!facts.session_base.empty()) {
      argv.insert(argv.end(), {"--mca", "orte_tmpdir_base", facts.session_base});
    }
  } else {
    if (!options.hostfile.empty()) argv.insert(argv.end(), {"--hostfile", options.hostfile});
    argv.insert(argv.end(), {"--map-by", fmt::format("ppr:{}:node", nproc_per_node)});
    // ppr fills the nodes in order: this many ranks take the first nnodes.
    if (options.nnodes > 0) {
      argv.insert(argv.end(), {"-np", std::to_string(options.nnodes * nproc_per_node)});
    }
  }
  if (options.timeout_seconds > 0) {
    argv.insert(argv.end(), {"--timeout", std::to_string(options.timeout_seconds),
                             "--report-state-on-timeout"});
  }
  // Local ranks inherit the environment anyway; ranks on other nodes get
  // only what -x names.
  for (const std::string& name : facts.forwarded_env) argv.insert(argv.end(), {"-x", name});
  argv.insert(argv.end(), command.begin(), command.end());
  return argv;
}

int run_mpirun(const std::vector<std::string>& argv, const LaunchOptions& options) {
  // The relay writes to the file descriptors: what the caller printed
  // through stdio comes first.
  std::fflush(stdout);
  std::fflush(stderr);
  SignalForwarding forwarding;
  const Child child = spawn(argv);
  forward_to = child.pid;
  // A signal that came while mpirun was starting could not be passed on.
  if (interrupted_by != 0) kill(child.pid, interrupted_by);
  std::array<Channel, 2> channels = {Channel(child.out, OutputStream::out),
                                     Channel(child.err, OutputStream::err)};
  Backstop backstop(options.timeout_seconds);
  const int status = relay(child, channels, backstop);
  forward_to = 0;
  return report(status, channels[0].messages.held() + channels[1].messages.held(), options,
                backstop.fired());
}

}  // namespace meshrun::launch
