"""`meshrun launch` as a user runs it.

Output: rank 0's lines plain, the others' prefixed "[rank N] ", stdout and
stderr kept apart. Every kind of failure (a non-zero exit, a rank killed
while waiting or in the middle of a collective, abort_rank, a job time
limit) ends the whole job within seconds, with a non-zero status and one
last line naming the rank and the reason instead of mpirun's banners. Bad
input exits with status 2 and one line.
Run by ctest: test_launch.py MESHRUN_EXE RANK_PROGRAM
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import InputErrorAssertions  # noqa: E402

MESHRUN = sys.argv[1] if len(sys.argv) > 1 else "meshrun"
PROGRAM = sys.argv[2] if len(sys.argv) > 2 else "meshrun-launch-rank-program"

# Not under this test's own launcher, if any: the launches must be real.
LAUNCHER_VARIABLES = ("OMPI_", "PMI_", "PMIX_", "SLURM_")


def environment(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    env.update(extra)
    return env


def launch(*args, timeout=60, **extra_env):
    """Runs `meshrun launch ARGS`; returns (result, seconds taken)."""
    start = time.monotonic()
    result = subprocess.run([MESHRUN, "launch", *args], capture_output=True, text=True,
                            errors="replace", timeout=timeout, env=environment(**extra_env))
    return result, time.monotonic() - start


def ranks(n, *program_args, options=()):
    return ["--nproc-per-node", str(n), *options, "--", PROGRAM, *program_args]


class OutputTest(unittest.TestCase):
    def test_rank_zero_plain_others_prefixed(self):
        result, _ = launch(*ranks(3, "env"), MESHRUN_TEST_VALUE="forwarded")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(sorted(result.stdout.splitlines()), [
            "[rank 1] rank 1 of 3 local 1 launcher openmpi value forwarded",
            "[rank 2] rank 2 of 3 local 2 launcher openmpi value forwarded",
            "rank 0 of 3 local 0 launcher openmpi value forwarded",
        ])
        self.assertEqual(sorted(result.stderr.splitlines()), [
            "[rank 1] stderr of rank 1", "[rank 2] stderr of rank 2", "stderr of rank 0"])

    def test_nested_launch_runs_in_place(self):
        inner = [MESHRUN, "launch", "--nproc-per-node", "4", "--", PROGRAM, "env"]
        result, _ = launch("--nproc-per-node", "2", "--", *inner)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(sorted(result.stdout.splitlines()), [
            "[rank 1] rank 1 of 2 local 1 launcher openmpi value unset",
            "rank 0 of 2 local 0 launcher openmpi value unset",
        ])

    def test_relaunch_self(self):
        result = subprocess.run([PROGRAM, "relaunch", "2"], capture_output=True, text=True,
                                timeout=60, env=environment())
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(sorted(result.stdout.splitlines()), [
            "[rank 1] rank 1 of 2 local 1 launcher openmpi value unset",
            "rank 0 of 2 local 0 launcher openmpi value unset",
        ])
        single = subprocess.run([PROGRAM, "relaunch", "1"], capture_output=True, text=True,
                                timeout=60, env=environment())
        self.assertEqual((single.returncode, single.stdout), (0, "no launcher\n"), single.stderr)

    def test_more_ranks_than_cores(self):
        n = (os.cpu_count() or 1) + 2
        result, _ = launch(*ranks(n, "env"))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(len(result.stdout.splitlines()), n)

    def test_hostfile(self):
        with tempfile.NamedTemporaryFile("w", suffix=".hosts") as hostfile:
            hostfile.write("localhost slots=2\n")
            hostfile.flush()
            result, _ = launch(*ranks(2, "env", options=("--hostfile", hostfile.name)))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(len(result.stdout.splitlines()), 2)


# Two nodes of two ranks simulated on this machine: MPI goes over TCP only,
# as between real nodes, and the mpi backend treats ranks 0-1 and 2-3 as
# separate nodes (hierarchical collectives across them).
SIMULATED_NODES = {"MESHRUN_RANKS_PER_NODE": "2", "OMPI_MCA_pml": "ob1",
                   "OMPI_MCA_btl": "tcp,self"}


def one_host_hostfile(slots):
    hostfile = tempfile.NamedTemporaryFile("w", suffix=".hosts")
    hostfile.write(f"# this machine\nlocalhost slots={slots}\n")
    hostfile.flush()
    return hostfile


class NodesTest(unittest.TestCase):
    def test_nnodes_takes_the_first_hosts(self):
        with one_host_hostfile(4) as hostfile:
            result, _ = launch(*ranks(3, "env", options=("--hostfile", hostfile.name,
                                                          "--nnodes", "1")))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(len(result.stdout.splitlines()), 3)

    def test_other_node_ranks_start_nothing(self):
        result, _ = launch(*ranks(2, "env", options=("--nnodes", "2", "--node-rank", "1")))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout, "")
        self.assertIn("node rank 1 of 2: nothing to start here", result.stderr)

    def test_rank_lost_on_one_node_ends_every_node(self):
        comm_timeout = 20
        with one_host_hostfile(4) as hostfile:
            result, seconds = launch(*ranks(4, "comm", "3", str(comm_timeout),
                                            options=("--hostfile", hostfile.name)),
                                     **SIMULATED_NODES)
        self.assertEqual(result.returncode, 137, result.stderr)
        self.assertLess(seconds, comm_timeout, result.stderr)
        self.assertRegex(result.stderr.splitlines()[-1],
                         r"^meshrun: error: rank 3 on node \S+ exited on signal 9 \(Killed\)$")

    def test_rank_stalled_on_one_node_times_out_the_others(self):
        comm_timeout = 2
        result, seconds = launch(*ranks(4, "stall", "3", str(comm_timeout)), **SIMULATED_NODES)
        self.assertEqual(result.returncode, 3, result.stderr)
        self.assertLess(seconds, comm_timeout + 10, result.stderr)
        self.assertRegex(result.stderr, r"(?m)^meshrun: error: rank [0-2] exited with status 3$")
        self.assertRegex(result.stderr, r"(?m)^(\[rank [0-2]\] )?meshrun: error: rank [0-2]: "
                                        r".*all_reduce .*within 2 s")


class FailureTest(unittest.TestCase):
    def assert_failure(self, result, seconds, status, last_line, within=10):
        self.assertEqual(result.returncode, status, result.stderr)
        self.assertLess(seconds, within, result.stderr)
        lines = result.stderr.splitlines()
        self.assertEqual(lines[-1], "meshrun: error: " + last_line, result.stderr)
        self.assertNotIn("-----", result.stderr)

    def test_rank_exits_non_zero(self):
        result, seconds = launch(*ranks(3, "exit", "1", "3"))
        self.assert_failure(result, seconds, 3, "rank 1 exited with status 3")

    def test_rank_killed(self):
        result, seconds = launch(*ranks(3, "kill", "2"))
        self.assert_failure(result, seconds, 137, "rank 2 exited on signal 9 (Killed)")

    def test_abort_rank(self):
        result, seconds = launch(*ranks(2, "abort", "1"))
        self.assert_failure(result, seconds, 3, "rank 1 exited with status 3")
        self.assertIn("[rank 1] meshrun: error: rank 1: simulated comm failure\n", result.stderr)

    def test_rank_killed_mid_collective(self):
        comm_timeout = 20
        result, seconds = launch(*ranks(2, "comm", "1", str(comm_timeout)))
        self.assert_failure(result, seconds, 137, "rank 1 exited on signal 9 (Killed)",
                            within=comm_timeout)

    def test_stalled_peer_times_out(self):
        comm_timeout = 2
        result, seconds = launch(*ranks(2, "stall", "1", str(comm_timeout)))
        self.assert_failure(result, seconds, 3, "rank 0 exited with status 3",
                            within=comm_timeout + 8)
        self.assertRegex(result.stderr, r"(?m)^meshrun: error: rank 0: .*all_reduce")

    def test_job_time_limit(self):
        result, seconds = launch(*ranks(3, "hang", "1", options=("--timeout", "2")))
        self.assert_failure(result, seconds, 124,
                            "the job timed out after 2 s; ranks still running: 1")

    def test_verbose_keeps_mpirun_messages(self):
        result, _ = launch(*ranks(2, "exit", "1", "3"), MESHRUN_LAUNCH_VERBOSE="1")
        self.assertEqual(result.returncode, 3, result.stderr)
        self.assertIn("Exit code:", result.stderr)
        self.assertTrue(result.stderr.endswith("rank 1 exited with status 3\n"), result.stderr)

    def test_sigterm_stops_the_job(self):
        marker = "sigterm-%d" % os.getpid()
        process = subprocess.Popen(
            [MESHRUN, "launch", *ranks(2, "wait", marker)], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=environment())
        time.sleep(1.5)
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
        self.assertLess(time.monotonic() - start, 10)
        self.assertEqual(process.returncode, 128 + signal.SIGTERM, stderr)
        self.assertTrue(stderr.endswith("interrupted by SIGTERM; the job was stopped\n"), stderr)
        self.assertEqual(self.processes_with(marker), [])

    @staticmethod
    def processes_with(marker):
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open("/proc/%s/cmdline" % pid, "rb") as cmdline:
                    if marker.encode() in cmdline.read():
                        found.append(pid)
            except OSError:
                pass
        return found


class BadInputTest(InputErrorAssertions):
    def test_bad_arguments(self):
        cases = [
            (["--nproc-per-node", "0", "--", PROGRAM], ["--nproc-per-node", "got '0'"]),
            (["--nproc-per-node", "x", "--", PROGRAM], ["--nproc-per-node"]),
            (["--nproc-per-node", "2", PROGRAM], ["--"]),
            (["--nproc-per-node", "2", "--"], ["COMMAND"]),
            (["--", PROGRAM], ["--nproc-per-node"]),
            (["--nproc-per-node", "2", "--bogus", "--", PROGRAM], ["--bogus"]),
            (["--nproc-per-node", "2", "--timeout", "-1", "--", PROGRAM], ["--timeout"]),
            (["--nproc-per-node", "2", "--", "/nonexistent/program"], ["/nonexistent/program"]),
            (["--nproc-per-node", "2", "--", "no-such-command-xyz"], ["no-such-command-xyz"]),
            (["--nproc-per-node", "2", "--hostfile", "/nonexistent/hosts", "--", PROGRAM],
             ["/nonexistent/hosts"]),
            (["--nproc-per-node", "2", "--nnodes", "2", "--", PROGRAM],
             ["--nnodes 2", "--hostfile", "Slurm allocation"]),
            (["--nproc-per-node", "2", "--nnodes", "0", "--", PROGRAM], ["--nnodes"]),
            (["--nproc-per-node", "2", "--node-rank", "1", "--", PROGRAM], ["--nnodes"]),
            (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--", PROGRAM],
             ["--node-rank", "[0, 1]"]),
        ]

        for args, needles in cases:
            with self.subTest(args=args):
                self.assert_input_error(launch(*args)[0], *needles)

    def test_hostfile_with_too_few_hosts(self):
        with one_host_hostfile(2) as hostfile:
            result, _ = launch("--nproc-per-node", "2", "--nnodes", "3", "--hostfile",
                               hostfile.name, "--", PROGRAM)
        self.assert_input_error(result, "--nnodes 3", "names 1 host (localhost)")

    def test_mpirun_missing(self):
        result, _ = launch(*ranks(2, "env"), PATH="/nonexistent")
        self.assert_input_error(result, "mpirun", "openmpi-bin")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
