"""`meshrun train` across nodes: simulated nodes under mpirun, and a real
Slurm on this machine under srun.

- SimulatedNodes: 2 nodes x 2 ranks (MESHRUN_RANKS_PER_NODE=2, MPI over TCP
  only) train as 1 rank does on the same global batch, under ddp (gradients
  all-reduced hierarchically) and fsdp2 over dp_shard 4 (parameters
  gathered and gradients reduce-scattered hierarchically).
- Slurm (tests/slurm/start-slurm.sh starts slurmctld, slurmd and munge in a
  private folder): `srun -n 4 meshrun train` trains with no launch flags
  and matches the same job launched through mpirun; a rank killed on one
  simulated node ends the step on every node within the comm timeout, and
  srun names the task and its host. Exits 77 (ctest's skip) with the
  reason when Slurm cannot start here.

Tolerance: 1e-4 relative on the losses against 1 rank (test_train.py says
why); the hierarchical sums add one more reordering of float32 sums.
Under srun and mpirun the same ranks compute the same sums: equal to 1e-6.

Run by ctest: test_nodes.py MESHRUN_EXE SimulatedNodes | Slurm
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train import MESHRUN, TOLERANCE, TrainTest, losses, metrics  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SLURM_SCRIPTS = os.path.join(HERE, "..", "slurm")
SIMULATED_NODES = {"MESHRUN_RANKS_PER_NODE": "2", "OMPI_MCA_pml": "ob1",
                   "OMPI_MCA_btl": "tcp,self"}
LAUNCHER_VARIABLES = ("OMPI_", "PMI_", "PMIX_", "SLURM_")
FSDP2 = ("distributed.strategy=fsdp2",)
COMM_TIMEOUT_S = 9
GRACE_S = 8


def environment(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    env.update(extra)
    return env


def assert_close(test, got, want, tolerance):
    test.assertEqual(len(got), len(want))
    for step, (a, b) in enumerate(zip(got, want), 1):
        test.assertLessEqual(abs(a - b), tolerance * abs(b), f"step {step}: {a} vs {b}")


class SimulatedNodes(TrainTest):
    def train_on_nodes(self, name, *args):
        output = os.path.join(self.runs.root, name)
        result = subprocess.run(
            [MESHRUN, "train", self.runs.config, "--nproc-per-node", "4", "--output", output,
             *args], capture_output=True, text=True, errors="replace", timeout=120,
            env=environment(**SIMULATED_NODES))
        self.assertEqual(result.returncode, 0, result.stderr)
        return output

    def test_ddp_across_nodes_matches_one_rank(self):
        reference = self.runs.train("ddp-1", 1)
        nodes = self.train_on_nodes("ddp-nodes")
        assert_close(self, losses(nodes), losses(reference), TOLERANCE)

    def test_fsdp2_across_nodes_matches_one_rank(self):
        """Launched as on a cluster: the hostfile's first node (this one)."""
        reference = self.runs.train("fsdp2-1", 1, *FSDP2)
        with tempfile.NamedTemporaryFile("w", suffix=".hosts") as hostfile:
            hostfile.write("localhost slots=4\n")
            hostfile.flush()
            nodes = self.train_on_nodes("fsdp2-nodes", "--hostfile", hostfile.name, "--nnodes",
                                        "1", *FSDP2)
        assert_close(self, losses(nodes), losses(reference), TOLERANCE)


class Slurm(TrainTest):
    """Needs the cluster started by __main__ (SLURM_ENV)."""

    def srun(self, name, *args, extra_env=None, **popen):
        output = os.path.join(self.runs.root, name)
        command = ["srun", "-n", "4", "--kill-on-bad-exit=1", MESHRUN, "train", self.runs.config,
                   "--output", output, *args]
        env = environment(**SLURM_ENV, **(extra_env or {}))
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, errors="replace", env=env, **popen), output

    def test_srun_trains_as_mpirun_does(self):
        job, output = self.srun("srun", *FSDP2)
        _, stderr = job.communicate(timeout=180)
        self.assertEqual(job.returncode, 0, stderr)
        self.assertEqual(len(metrics(output)), 4)
        launched = self.runs.train("mpirun", 4, *FSDP2)
        assert_close(self, losses(output), losses(launched), 1e-6)

    def test_rank_killed_on_one_node_ends_the_job(self):
        job, output = self.srun(
            "killed", *FSDP2, "train.steps=100000", "train.val_every=0", "checkpoint.export=false",
            f"comm.timeout_minutes={COMM_TIMEOUT_S / 60}", extra_env=SIMULATED_NODES)
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(output, "metrics.jsonl")) or \
                len(metrics(output)) < 3:
            self.assertIsNone(job.poll(), job.communicate()[1] if job.poll() is not None else "")
            self.assertLess(time.monotonic(), deadline, "the job did not train")
            time.sleep(0.2)
        os.kill(rank_pid(output, 3), signal.SIGKILL)
        start = time.monotonic()
        _, stderr = job.communicate(timeout=COMM_TIMEOUT_S + 60)
        self.assertNotEqual(job.returncode, 0, stderr)
        self.assertLess(time.monotonic() - start, COMM_TIMEOUT_S + GRACE_S, stderr)
        host = socket.gethostname().split(".")[0]
        self.assertRegex(stderr, rf"srun: error: {re.escape(host)}: task 3: Killed")


def rank_pid(output, rank):
    """The pid of srun task `rank` of the job writing to `output`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().split(b"\0")
            if output.encode() not in command or command[0].endswith(b"srun"):
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"\0SLURM_PROCID={rank}\0".encode() in b"\0" + f.read():
                    return int(pid)
        except OSError:
            pass
    raise AssertionError(f"no process of rank {rank} writing to {output}")


SLURM_ENV = {}


def start_slurm(state):
    """Starts the private cluster; exits 77 (skip) or 1 when it cannot."""
    started = subprocess.run([os.path.join(SLURM_SCRIPTS, "start-slurm.sh"), state],
                             capture_output=True, text=True, timeout=120)
    if started.returncode != 0:
        print(started.stdout.strip() or started.stderr.strip())
        shutil.rmtree(state, ignore_errors=True)
        sys.exit(77 if started.returncode == 77 else 1)
    name, value = started.stdout.strip().splitlines()[-1].split("=", 1)
    SLURM_ENV[name] = value


def main():
    classes = sys.argv[2:]
    # Unix socket paths under the state folder must stay short.
    state = tempfile.mkdtemp(prefix="meshrun-slurm.", dir="/tmp") if "Slurm" in classes else None
    if state:
        start_slurm(state)
    try:
        result = unittest.main(argv=sys.argv[:1] + classes, verbosity=2, exit=False).result
    finally:
        if state:
            subprocess.run([os.path.join(SLURM_SCRIPTS, "stop-slurm.sh"), state],
                           capture_output=True, timeout=120)
            shutil.rmtree(state, ignore_errors=True)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
