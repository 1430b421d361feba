// Running Open MPI's mpirun for launch_local: its command line, and the
// child process whose output is relayed and whose failures are condensed.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "launch/launch.hpp"

namespace meshrun::launch {

// What the mpirun command line depends on besides the request itself.
struct HostFacts {
  std::string mpirun;  // path of the executable
  bool root = false;
  int cpus = 1;                            // CPUs this process may run on
  std::vector<std::string> forwarded_env;  // names to pass with -x
  // The environment names Open MPI's transport (OMPI_MCA_pml, _btl or _mtl):
  // meshrun then leaves the choice to it.
  bool transport_chosen = false;
  // A folder of this launch's own for Open MPI's session files on this
  // machine (SessionDirectory); empty: Open MPI's default.
  std::string session_base = {};
};

// A folder of one launch's own for Open MPI's session files, removed with
// what is in it when the launch ends. Launches that start together
// otherwise race to create the one Open MPI shares
// (/tmp/ompi.<host>.<uid>), and the loser fails in orte_init ("mkdir ...:
// File exists"). Made under $TMPDIR, else /tmp; where it cannot be made,
// path() is empty and Open MPI's default serves.
class SessionDirectory {
 public:
  SessionDirectory();
  ~SessionDirectory();
  SessionDirectory(const SessionDirectory&) = delete;
  SessionDirectory& operator=(const SessionDirectory&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// `name` as execvp would find it: itself when it has a '/', else the first
// executable file of that name in a folder of PATH.
std::optional<std::string> find_on_path(const std::string& name);

// The facts of this process: mpirun found on PATH (throws meshrun::Error
// NOT_FOUND naming Debian's openmpi-bin when it is not), effective user,
// CPU affinity, and the MESHRUN_* and OPENBLAS_* variables of the environment.
HostFacts host_facts();

// mpirun's argv for nproc_per_node ranks of `command`.
std::vector<std::string> mpirun_command(int nproc_per_node, const std::vector<std::string>& command,
                                        const LaunchOptions& options, const HostFacts& facts);

// Runs `argv` (an mpirun command line), relays its output and returns the
// job's exit status, printing one error line when the job failed.
int run_mpirun(const std::vector<std::string>& argv, const LaunchOptions& options);

}  // namespace meshrun::launch
