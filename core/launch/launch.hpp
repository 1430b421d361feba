// Starting the ranks of a job and ending it cleanly when one fails.
//
// meshrun starts local ranks through Open MPI's `mpirun` (Debian package
// openmpi-bin); under a launcher that already started the ranks (mpirun,
// srun, a PMI/PMIx process manager) it reads rank and size from the
// environment and does not launch again. docs/launch.md has the user's view.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace meshrun::launch {

// What a launcher told this process about its place in the job.
struct LaunchEnvironment {
  std::string launcher;  // "openmpi", "slurm", "pmi" or "pmix"
  int64_t rank = 0;
  // Unknown under a bare PMIx launcher, which does not export the size;
  // the comm backend knows it once the world communicator exists.
  std::optional<int64_t> size;
  std::optional<int64_t> local_rank;
};

// The launcher this process runs under, from its environment variables:
// Open MPI (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK), Slurm srun
// (SLURM_PROCID/SLURM_STEP_NUM_TASKS or SLURM_NTASKS/SLURM_LOCALID, only
// inside a job step), MPICH-style PMI (PMI_RANK/PMI_SIZE) and PMIx
// (PMIX_RANK), tried in that order. std::nullopt when there is none.
std::optional<LaunchEnvironment> detect_launcher();

// The same, reading variables through `getenv` (a test seam).
using GetEnv = std::function<const char*(const char* name)>;
std::optional<LaunchEnvironment> detect_launcher(const GetEnv& getenv);

struct LaunchOptions {
  // mpirun's --hostfile: one line per node, "HOST slots=N". Empty: this
  // machine only, or a Slurm allocation's nodes (below). With a hostfile,
  // nproc_per_node ranks start on every host, or on the first `nnodes`.
  std::string hostfile;
  // Limit on the whole job (0: none). When it expires mpirun stops every
  // rank and the launcher reports the ranks that had not finished.
  int timeout_seconds = 0;
  // The nodes to run on, nproc_per_node ranks on each; 0: every host of the
  // hostfile, or this machine without one. More than one without a hostfile
  // needs a Slurm allocation (an sbatch script, a salloc shell) of that many
  // nodes, whose nodes mpirun then uses.
  int nnodes = 0;

  // Whether the ranks may run on more than this machine.
  bool spans_nodes() const { return !hostfile.empty() || nnodes > 1; }
};

// The hosts a hostfile names, in order, once each: the first word of every
// line that is not blank or a comment. Throws NOT_FOUND when it cannot be
// read.
std::vector<std::string> hostfile_hosts(const std::string& hostfile);

// Runs `command` as nproc_per_node ranks under mpirun (found on PATH) and
// waits for them. Rank 0's output is passed through plainly, every other
// rank's lines are prefixed "[rank N] "; stdout stays stdout, stderr stays
// stderr. SIGINT and SIGTERM sent to this process are passed on to mpirun.
// When a rank fails, mpirun stops the others and this prints one line,
// "meshrun: error: rank 1 exited on signal 9 (Killed)", instead of mpirun's
// banners (MESHRUN_LAUNCH_VERBOSE=1 shows them too).
//
// The ranks get the OpenBLAS kernels of this CPU (prefer_fast_blas_kernels).
// Returns the job's exit status: 0, a failed rank's own status, 128 + the
// signal that killed it, 124 on timeout, or mpirun's status. Throws
// meshrun::Error before starting anything when the input is bad
// (nproc_per_node < 1, no command, a missing hostfile or local command) or
// when mpirun is not installed.
int launch_local(int nproc_per_node, const std::vector<std::string>& command,
                 const LaunchOptions& options = {});

// OpenBLAS 0.3.21 does not recognise recent CPUs and falls back to its
// slowest (Prescott) kernels: a training step, meshrun's or PyTorch's, runs
// 3.5x slower. Unless the user chose (OPENBLAS_CORETYPE set), this sets
// OPENBLAS_CORETYPE to the kernels of the newest instruction set this CPU
// has, which OpenBLAS reads when it loads: it reaches the processes started
// after this. Returns whether it set it.
bool prefer_fast_blas_kernels();

// For commands whose process is itself one rank (`meshrun train ...
// --nproc-per-node N`, `meshrun bench comm --nproc N`). Call first thing:
//
//   if (auto status = relaunch_self_if_needed(nproc, argc, argv)) return *status;
//   ... go on as one rank (detect_launcher() says which) ...
//
// - Under a launcher: returns std::nullopt; the launcher's world size
//   wins over nproc_per_node.
// - No launcher, nproc_per_node == 1 and no job timeout: returns
//   std::nullopt; this process is the only rank. When OPENBLAS_CORETYPE is
//   unset it first sets it for this CPU and re-executes itself once, so
//   OpenBLAS loads those kernels.
// - Otherwise (with a job timeout, one rank too: mpirun enforces it): runs
//   this executable (/proc/self/exe) with argv[1..] as nproc_per_node ranks
//   through launch_local (with OPENBLAS_CORETYPE set for this CPU unless the
//   user set it), and returns the job's exit status for the caller to
//   return from main. Inside those ranks the same call returns
//   std::nullopt, so the arguments need no change.
// Throws as launch_local.
std::optional<int> relaunch_self_if_needed(int nproc_per_node, int argc, char** argv,
                                           const LaunchOptions& options = {});

// "interrupted by SIGINT; the job was stopped": why a job stopped by SIGINT
// or SIGTERM ended, launched or not.
std::string interrupted_message(int signal);

// For a process that is the whole job (one rank, no launcher): SIGINT and
// SIGTERM end it as they end a launched job, with "meshrun: error:
// interrupted by SIGINT; the job was stopped" and status 128 + the signal,
// skipping destructors that could block.
void stop_job_on_interrupt();

// Ends this rank after an error it cannot recover from (a comm operation
// that failed or timed out): prints "meshrun: error: rank R: MESSAGE" on
// stderr and exits with status 3, so that mpirun stops the other ranks and
// the launcher names this one. Skips destructors and atexit handlers: they
// could block in the comm backend waiting for the peers this rank gives up
// on.
[[noreturn]] void abort_rank(int64_t rank, const std::string& message);

}  // namespace meshrun::launch
