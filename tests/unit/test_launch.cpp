// The launcher's pure parts: which launcher an environment shows, the mpirun
// command line, and reading mpirun's output. The mpirun messages below were
// captured from Open MPI 4.1.4's mpirun (Debian 12) running programs that
// fail in each way; tests/launch/ runs the real thing.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "launch/launch.hpp"
#include "launch/mpirun.hpp"
#include "launch/mpirun_output.hpp"

using meshrun::launch::detect_launcher;
using meshrun::launch::OutputLine;
using meshrun::launch::OutputStream;
using meshrun::launch::summarize_mpirun_messages;

namespace {

std::optional<meshrun::launch::LaunchEnvironment> detect(
    const std::map<std::string, std::string>& variables) {
  return detect_launcher([&](const char* name) -> const char* {
    const auto found = variables.find(name);
    return found == variables.end() ? nullptr : found->second.c_str();
  });
}

constexpr const char* kExitCode =
    R"(--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[4828,1],1]
  Exit code:    3
--------------------------------------------------------------------------
)";

constexpr const char* kKilled =
    R"(--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).
--------------------------------------------------------------------------
)";

constexpr const char* kAbort =
    R"(--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD
with errorcode 5.

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
You may or may not see output from other processes, depending on
exactly when Open MPI kills them.
--------------------------------------------------------------------------
)";

constexpr const char* kImproper =
    R"(--------------------------------------------------------------------------
mpirun has exited due to process rank 1 with PID 0 on
node vm exiting improperly. There are three reasons this could occur:

1. this process did not call "init" before exiting, but others in
the job did. This can cause a job to hang indefinitely while it waits
for all processes to call "init". By rule, if one process calls "init",
then ALL processes must call "init" prior to termination.
--------------------------------------------------------------------------
)";

constexpr const char* kNoExecutable =
    R"(--------------------------------------------------------------------------
mpirun was unable to launch the specified application as it could not access
or execute an executable:

Executable: ./nonexist
Node: vm

while attempting to start process rank 0.
--------------------------------------------------------------------------
)";

constexpr const char* kNoHostfile =
    R"(--------------------------------------------------------------------------
Open RTE was unable to open the hostfile:
    /nonexist
Check to make sure the path and filename are correct.
--------------------------------------------------------------------------
)";

constexpr const char* kSlots =
    R"(--------------------------------------------------------------------------
There are not enough slots available in the system to satisfy the 2
slots that were requested by the application:

  ./prog.sh
--------------------------------------------------------------------------
)";

constexpr const char* kTimeout =
    "--------------------------------------------------------------------------\n"
    "The user-provided time limit for job execution has been reached:\n"
    "\n"
    "  Timeout: 3 seconds\n"
    "\n"
    "The job will now be aborted.  Please check your code and/or\n"
    "adjust/remove the job execution time limit (as specified by --timeout\n"
    "command line option or MPIEXEC_TIMEOUT environment variable).\n"
    "--------------------------------------------------------------------------\n"
    "DATA FOR JOB: [4991,0]\n"
    "\tNum apps: 1\tNum procs: 1\tJobState: ALL DAEMONS REPORTED\tAbort: False\n"
    "\tNum launched: 0\tNum reported: 1\tNum terminated: 0\n"
    "\n"
    "\tProcs:\n"
    "\t\tRank: 0\tNode: vm\tPID: 32641\tState: RUNNING\tExitCode 0\n"
    "\n"
    "DATA FOR JOB: [4991,1]\n"
    "\tNum apps: 1\tNum procs: 3\tJobState: RUNNING\tAbort: False\n"
    "\tNum launched: 3\tNum reported: 0\tNum terminated: 2\n"
    "\n"
    "\tProcs:\n"
    "\t\tRank: 0\tNode: vm\tPID: 32645\tState: NORMALLY TERMINATED\tExitCode 0\n"
    "\t\tRank: 1\tNode: vm\tPID: 32646\tState: RUNNING\tExitCode 0\n"
    "\t\tRank: 2\tNode: vm\tPID: 32647\tState: SYNC REGISTERED\tExitCode 0\n"
    "\n";

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t end; (end = text.find('\n', start)) != std::string::npos; start = end + 1) {
    lines.push_back(text.substr(start, end - start));
  }
  return lines;
}

// Everything `decoder` makes of `chunks`, as "R:o:text" (R = rank or "-",
// o = o/e for stdout/stderr).
std::vector<std::string> decode(const std::vector<std::string>& chunks,
                                OutputStream pipe = OutputStream::out) {
  meshrun::launch::TaggedOutputDecoder decoder(pipe);
  std::vector<OutputLine> lines;
  for (const std::string& chunk : chunks) {
    for (OutputLine& line : decoder.feed(chunk)) lines.push_back(std::move(line));
  }
  for (OutputLine& line : decoder.finish()) lines.push_back(std::move(line));
  std::vector<std::string> shown;
  for (const OutputLine& line : lines) {
    shown.push_back(fmt::format("{}:{}:{}", line.rank ? std::to_string(*line.rank) : "-",
                                line.stream == OutputStream::out ? "o" : "e", line.text));
  }
  return shown;
}

}  // namespace

TEST_CASE("launch: detect_launcher with no launcher", "[launch]") {
  CHECK_FALSE(detect({}).has_value());
  CHECK_FALSE(detect({{"OMPI_COMM_WORLD_RANK", "x"}}).has_value());
  CHECK_FALSE(detect({{"OMPI_COMM_WORLD_RANK", "-1"}}).has_value());
}

TEST_CASE("launch: detect_launcher reads Open MPI before PMIx", "[launch]") {
  const auto found = detect({{"OMPI_COMM_WORLD_RANK", "2"},
                             {"OMPI_COMM_WORLD_SIZE", "4"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                             {"PMIX_RANK", "2"}});
  REQUIRE(found.has_value());
  CHECK(found->launcher == "openmpi");
  CHECK(found->rank == 2);
  CHECK(found->size == 4);
  CHECK(found->local_rank == 0);
}

TEST_CASE("launch: detect_launcher reads srun's job steps only", "[launch]") {
  // What an sbatch script sees: the allocation, no step.
  const std::map<std::string, std::string> batch = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}};
  CHECK_FALSE(detect(batch).has_value());

  const std::map<std::string, std::string> step = {{"SLURM_STEP_ID", "0"},
                                                   {"SLURM_PROCID", "5"},
                                                   {"SLURM_NTASKS", "8"},
                                                   {"SLURM_STEP_NUM_TASKS", "6"},
                                                   {"SLURM_LOCALID", "1"}};
  const auto found = detect(step);
  REQUIRE(found.has_value());
  CHECK(found->launcher == "slurm");
  CHECK(found->rank == 5);
  CHECK(found->size == 6);
  CHECK(found->local_rank == 1);

  const auto old_slurm =
      detect({{"SLURM_STEPID", "3"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}});
  REQUIRE(old_slurm.has_value());
  CHECK(old_slurm->size == 2);
}

TEST_CASE("launch: detect_launcher reads PMI and PMIx", "[launch]") {
  const auto pmi = detect({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}});
  REQUIRE(pmi.has_value());
  CHECK(pmi->launcher == "pmi");
  CHECK(pmi->rank == 3);
  CHECK(pmi->size == 4);
  CHECK(pmi->local_rank == 1);

  const auto pmix = detect({{"PMIX_RANK", "7"}});
  REQUIRE(pmix.has_value());
  CHECK(pmix->launcher == "pmix");
  CHECK(pmix->rank == 7);
  CHECK_FALSE(pmix->size.has_value());
  CHECK_FALSE(pmix->local_rank.has_value());
}

TEST_CASE("launch: mpirun command line", "[launch]") {
  meshrun::launch::HostFacts facts{"/usr/bin/mpirun", false, 2, {"MESHRUN_LOG_LEVEL"}};
  const std::vector<std::string> program = {"./train", "--steps", "3"};
  using Argv = std::vector<std::string>;

  CHECK(meshrun::launch::mpirun_command(2, program, {}, facts) ==
        Argv{"/usr/bin/mpirun", "--tag-output", "--bind-to", "none", "--use-hwthread-cpus", "-np",
             "2", "--mca", "pml", "ob1", "--mca", "btl", "self,vader", "-x", "MESHRUN_LOG_LEVEL",
             "./train", "--steps", "3"});
  // A transport named in the environment is the user's choice.
  facts.transport_chosen = true;
  // Open MPI's session files go to the launch's own folder on this machine.
  facts.session_base = "/tmp/meshrun-session-abc123";
  CHECK(meshrun::launch::mpirun_command(2, program, {}, facts) ==
        Argv{"/usr/bin/mpirun", "--tag-output", "--bind-to", "none", "--use-hwthread-cpus", "-np",
             "2", "--mca", "orte_tmpdir_base", "/tmp/meshrun-session-abc123", "-x",
             "MESHRUN_LOG_LEVEL", "./train", "--steps", "3"});
  facts.session_base.clear();

  facts.root = true;
  facts.forwarded_env.clear();
  CHECK(meshrun::launch::mpirun_command(3, program, {"", 60}, facts) ==
        Argv{"/usr/bin/mpirun", "--tag-output", "--bind-to", "none", "--allow-run-as-root",
             "--use-hwthread-cpus", "-np", "3", "--oversubscribe", "--timeout", "60",
             "--report-state-on-timeout", "./train", "--steps", "3"});

  facts.root = false;
  CHECK(meshrun::launch::mpirun_command(4, program, {"hosts.txt", 0}, facts) ==
        Argv{"/usr/bin/mpirun", "--tag-output", "--bind-to", "none", "--hostfile", "hosts.txt",
             "--map-by", "ppr:4:node", "./train", "--steps", "3"});
  // --nnodes: the first nodes of the hostfile, or of the Slurm allocation.
  CHECK(meshrun::launch::mpirun_command(4, program, {"hosts.txt", 0, 2}, facts) ==
        Argv{"/usr/bin/mpirun", "--tag-output", "--bind-to", "none", "--hostfile", "hosts.txt",
             "--map-by", "ppr:4:node", "-np", "8", "./train", "--steps", "3"});
  CHECK(meshrun::launch::mpirun_command(2, program, {"", 0, 3}, facts) ==
        Argv{"/usr/bin/mpirun", "--tag-output", "--bind-to", "none", "--map-by", "ppr:2:node",
             "-np", "6", "./train", "--steps", "3"});
}

TEST_CASE("launch: a session folder of its own, gone when the launch ends", "[launch]") {
  std::string path;
  {
    const meshrun::launch::SessionDirectory session;
    path = session.path();
    REQUIRE_FALSE(path.empty());
    CHECK(std::filesystem::is_directory(path));
    std::ofstream(path + "/left-by-open-mpi") << "session file";
    std::filesystem::create_directory(path + "/ompi.host.0");
  }
  CHECK_FALSE(std::filesystem::exists(path));
}

TEST_CASE("launch: tagged output becomes lines per rank", "[launch]") {
  CHECK(decode({"[1,0]<stdout>:hello 0\n[1,12]<stderr>:oops\nmpirun says\n"}) ==
        std::vector<std::string>{"0:o:hello 0", "12:e:oops", "-:o:mpirun says"});
  CHECK(decode({"[1,3]<stddiag>:diag\nplain\n"}, OutputStream::err) ==
        std::vector<std::string>{"3:e:diag", "-:e:plain"});
}

TEST_CASE("launch: interleaved partial lines are put back together", "[launch]") {
  // Two ranks each printf("partial-R"), sleep, printf(" rest\n"), printf("noeol-R").
  CHECK(decode({"[1,0]<stdout>:partial-0[1,1]<stdout>:partial-1[1,0]<stdout>: rest\n"
                "[1,0]<stdout>:noeol-0[1,1]<stdout>: rest\n"
                "[1,1]<stdout>:noeol-1"}) ==
        std::vector<std::string>{"0:o:partial-0 rest", "1:o:partial-1 rest", "0:o:noeol-0",
                                 "1:o:noeol-1"});
  // A segfault backtrace, written in pieces by one rank.
  CHECK(decode({"[1,1]<stderr>:[vm:32481] [ 0] [1,1]<stderr>:/lib/libc.so.6(+0x3c050)\n"}) ==
        std::vector<std::string>{"1:e:[vm:32481] [ 0] /lib/libc.so.6(+0x3c050)"});
}

TEST_CASE("launch: a tag split between reads is still a tag", "[launch]") {
  CHECK(decode({"[1,", "2]<std", "out>:x\n[", "vm] y\n"}) ==
        std::vector<std::string>{"2:o:x", "-:o:[vm] y"});
  CHECK(decode({"[1,2]<std"}) == std::vector<std::string>{"-:o:[1,2]<std"});
}

TEST_CASE("launch: rank 0 plain, other ranks prefixed", "[launch]") {
  CHECK(meshrun::launch::rank_line(0, "loss 2.5") == "loss 2.5");
  CHECK(meshrun::launch::rank_line(3, "loss 2.5") == "[rank 3] loss 2.5");
}

TEST_CASE("launch: mpirun's failure messages in one line", "[launch]") {
  struct Sample {
    const char* text;
    std::string message;
    int status;
  };
  const std::vector<Sample> samples = {
      {kExitCode, "rank 1 exited with status 3", 3},
      {kKilled, "rank 1 exited on signal 9 (Killed)", 137},
      {kAbort, "rank 1 called MPI_Abort with error code 5", 5},
      {kImproper, "rank 1 exited without calling MPI_Finalize while other ranks were still running",
       1},
      {kNoExecutable, "cannot run './nonexist': not found or not executable", 2},
      {kNoHostfile, "cannot open hostfile '/nonexist'", 2},
      {kSlots,
       "the hosts have fewer slots than the 2 ranks asked for; raise slots=N in the hostfile", 2},
      {kTimeout, "the job timed out after 3 s; ranks still running: 1, 2", 124},
  };
  for (const Sample& sample : samples) {
    INFO(sample.text);
    const auto failure = summarize_mpirun_messages(sample.text);
    REQUIRE(failure.has_value());
    CHECK(failure->message == sample.message);
    CHECK(failure->exit_status == sample.status);
  }
  CHECK(summarize_mpirun_messages(kKilled, true)->message ==
        "rank 1 on node vm exited on signal 9 (Killed)");
  CHECK_FALSE(summarize_mpirun_messages("2 total processes failed to start\n").has_value());
}

TEST_CASE("launch: failure banners are held back, warnings shown", "[launch]") {
  meshrun::launch::MpirunMessages messages;
  std::vector<std::string> shown;
  const std::string warning =
      "--------------------------------------------------------------------------\n"
      "WARNING: something to know about\n"
      "--------------------------------------------------------------------------\n";
  for (const std::string& line : lines_of(warning + kKilled + "after\n")) {
    for (const std::string& out : messages.add(line)) shown.push_back(out);
  }
  CHECK(shown == lines_of(warning));
  CHECK(messages.held() == std::string(kKilled) + "after\n");
  CHECK(messages.finish().empty());
}

TEST_CASE("launch: the state report on a time limit is held back", "[launch]") {
  meshrun::launch::MpirunMessages messages;
  // On its own pipe, the report may come before the banner that explains it.
  const std::string report = std::string(kTimeout).substr(std::string(kTimeout).find("DATA"));
  for (const std::string& line : lines_of(report)) CHECK(messages.add(line).empty());
  CHECK(messages.add("later line") == std::vector<std::string>{"later line"});
}
