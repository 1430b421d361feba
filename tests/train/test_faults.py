"""`meshrun train` when training or a rank goes wrong.

- A step whose loss or gradient norm is not finite (train.lr = 1e30) stops
  the run with status 1 and one line naming the step and the first
  parameter whose gradient is not finite, under ddp, fsdp2 and a pipeline;
  train.skip_nonfinite_steps = N skips N such steps in a row first.
- A rank that stops (SIGSTOP) ends the job within comm.timeout_minutes plus
  a few seconds, naming the rank that gave up and the operation, with a
  pipeline or ring attention (transfers in flight) as without.
- SIGINT ends every rank: status 130, "interrupted"; --timeout ends the job
  with status 124.
- A rank whose memory cannot hold the model names the rank, the device and
  the bytes, and no output folder is left; one whose memory cannot hold a
  step's activations names them too, with the step, and no step is
  recorded.

Run by ctest: test_faults.py MESHRUN_EXE [TestClass ...]
"""

import concurrent.futures
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train import MESHRUN, TrainTest  # noqa: E402
from meshrun_testing import InputErrorAssertions  # noqa: E402

PIPELINE = ("distributed.strategy=fsdp2", "distributed.pp_size=2",
            "distributed.pipeline.pp_microbatch_size=2", "distributed.pipeline.pp_batch_size=8")
FSDP2 = ("distributed.strategy=fsdp2",)
DDP = ()
DIVERGES = ("train.lr=1e30", "train.steps=8")
ENDLESS = ("train.steps=1000000", "train.val_every=0", "train.log_every=1000000",
           "checkpoint.export=false")
# Long enough that a loaded machine never trips it during a healthy step.
COMM_TIMEOUT_S = 9
# A fault must end the job within the comm timeout plus this.
GRACE_S = 8

STOP_LINE = re.compile(r"meshrun: error: step (\d+): the loss is \S+ and the gradient norm is "
                       r"\S+; the gradient of '([^']+)' is not finite \(rank \d\); the run stops")
LAUNCHER_VARIABLES = ("OMPI_", "PMI_", "PMIX_", "SLURM_")


def environment():
    return {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}


def train(runs, name, nproc, *args):
    output = os.path.join(runs.root, name)
    result = subprocess.run(
        [MESHRUN, "train", runs.config, "--nproc-per-node", str(nproc), "--output", output,
         *args], capture_output=True, text=True, errors="replace", timeout=120, env=environment())
    return result, output


def metrics_lines(output):
    try:
        with open(os.path.join(output, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


def processes_with(marker):
    """(pid, world rank or None) of every process whose command line has `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open("/proc/%s/environ" % pid, "rb") as f:
                rank = re.search(rb"\0OMPI_COMM_WORLD_RANK=(\d+)\0", b"\0" + f.read())
            found.append((int(pid), int(rank.group(1)) if rank else None))
        except OSError:
            pass
    return found


class Job:
    """`meshrun train` started in the background on a config that trains on."""

    def __init__(self, runs, name, nproc, *args):
        self.output = os.path.join(runs.root, name)
        self.process = subprocess.Popen(
            [MESHRUN, "train", runs.config, "--nproc-per-node", str(nproc), "--output",
             self.output, *ENDLESS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, errors="replace", env=environment())

    def wait_for_steps(self, steps=3, limit=60):
        deadline = time.monotonic() + limit
        while len(metrics_lines(self.output)) < steps:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the job did not train: " + self.process.communicate()[1])
            time.sleep(0.1)

    def rank_pid(self, rank):
        return next(pid for pid, r in processes_with(self.output) if r == rank)

    def finish(self, limit=60):
        """(status, stderr, seconds until it ended)."""
        start = time.monotonic()
        _, stderr = self.process.communicate(timeout=limit)
        self.ended_at = time.monotonic()
        return self.process.returncode, stderr, self.ended_at - start

    def leftovers(self):
        """Processes of the job still there after it ended, killed."""
        time.sleep(0.5)
        left = processes_with(self.output)
        for pid, _ in left:
            os.kill(pid, signal.SIGKILL)
        return left


class NonFinite(TrainTest):
    def assert_stops(self, name, nproc, *overrides):
        result, output = train(self.runs, name, nproc, *DIVERGES, *overrides)
        self.assertEqual(result.returncode, 1, result.stderr)
        stops = [line for line in result.stderr.splitlines() if STOP_LINE.search(line)]
        self.assertEqual(len(stops), 1, result.stderr)
        step, parameter = STOP_LINE.search(stops[0]).groups()
        self.assertRegex(parameter, r"^(model\.|lm_head)")
        logged = metrics_lines(output)
        self.assertEqual([m["step"] for m in logged], list(range(1, int(step) + 1)))
        last = logged[-1]
        self.assertTrue(last["loss"] is None or last["grad_norm"] is None, last)
        self.assertTrue(last["skipped"])
        return result, logged

    def test_ddp_stops_at_the_first_nonfinite_step(self):
        self.assert_stops("ddp", 2, *DDP)

    def test_fsdp2_stops_at_the_first_nonfinite_step(self):
        self.assert_stops("fsdp2", 2, *FSDP2)

    def test_pipeline_stops_at_the_first_nonfinite_step(self):
        self.assert_stops("pipeline", 2, *PIPELINE)

    def test_skipped_steps_then_stop(self):
        result, logged = self.assert_stops("skip", 2, *FSDP2, "train.skip_nonfinite_steps=2")
        self.assertEqual([m.get("skipped", False) for m in logged[-3:]], [True] * 3)
        self.assertFalse(logged[0].get("skipped", False))
        self.assertIn("the run stops after 3 such steps in a row (train.skip_nonfinite_steps = 2)",
                      result.stderr)
        warnings = [line for line in result.stderr.splitlines()
                    if "meshrun: warning: step" in line and "the update is skipped" in line]
        self.assertEqual(len(warnings), 2, result.stderr)


class BadInput(TrainTest, InputErrorAssertions):
    def test_bad_values_name_their_key(self):
        for args, needles in [
            (["train.skip_nonfinite_steps=-1"], ["train.skip_nonfinite_steps"]),
            (["--timeout", "-1"], ["--timeout"]),
            (["--timeout", "soon"], ["--timeout"]),
        ]:
            with self.subTest(args=args):
                self.assert_input_error(train(self.runs, "bad", 1, *args)[0], *needles)


class OutOfMemory(TrainTest):
    """A rank whose memory cannot hold the model (an address-space limit
    below it, as a small machine has): every rank names itself, the device
    and the bytes asked for, the job ends with status 3, and the output
    folder, whose name was chosen but where nothing was written yet, is not
    left behind. One whose memory holds the model but not a step's
    activations says the same with the step and the model's call, and
    records no step."""

    def train_in_6_gib(self, name, *overrides):
        """Two ranks, each under a 6 GiB address-space limit."""
        limit = 6 << 30
        output = os.path.join(self.runs.root, name)
        result = subprocess.run(
            [MESHRUN, "train", self.runs.config, "--nproc-per-node", "2", "--output", output,
             *overrides], capture_output=True, text=True, errors="replace", timeout=120,
            env=environment(),
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
        return result, output

    def test_a_rank_out_of_memory_at_setup_names_the_bytes_and_leaves_no_folder(self):
        # The model's weights alone are 26 GB.
        big = ("model.hidden_size=8192", "model.intermediate_size=22016",
               "model.num_hidden_layers=8", "model.num_attention_heads=64",
               "model.num_key_value_heads=8", "train.steps=2")
        result, output = self.train_in_6_gib("out-of-memory", *big)
        self.assertEqual(result.returncode, 3, result.stderr)
        for rank in (0, 1):
            self.assertRegex(result.stderr, rf"(?m)rank {rank}: out of memory: the host's memory "
                                            r"\(cpu\) cannot give the \d+ bytes asked for$")
        self.assertFalse(os.path.exists(output), os.listdir(self.runs.root))

    def test_a_rank_out_of_memory_in_a_step_names_the_bytes(self):
        # The weights fit; a micro-batch's MLP rows need 17 GB.
        wide = ("model.intermediate_size=262144", "train.global_batch_size=512",
                "train.micro_batch_size=256", "train.steps=2")
        result, output = self.train_in_6_gib("out-of-memory-in-a-step", *wide)
        self.assertEqual(result.returncode, 3, result.stderr)
        for rank in (0, 1):
            self.assertRegex(result.stderr, rf"(?m)rank {rank}: step 1: model llama \S+: out of "
                                            r"memory: the host's memory \(cpu\) cannot give the "
                                            r"\d+ bytes asked for$")
        with open(os.path.join(output, "metrics.jsonl")) as f:
            self.assertEqual(f.read(), "")


class Hangs(TrainTest):
    """A rank stopped (SIGSTOP) in a pipeline, in fsdp2's collectives and in
    ring attention's transfers: the others end the job within the comm
    timeout. The three jobs run at once, since each mostly waits for its
    timeout; each is timed from the moment its rank was stopped."""

    JOBS = {"pipeline": PIPELINE, "fsdp2": FSDP2, "cp2": (*FSDP2, "distributed.cp_size=2")}

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        timeout = "comm.timeout_minutes=%g" % (COMM_TIMEOUT_S / 60)
        jobs = {name: Job(cls.runs, name, 2, timeout, *overrides)
                for name, overrides in cls.JOBS.items()}
        stopped_at = {}
        try:
            for name, job in jobs.items():
                job.wait_for_steps()
                os.kill(job.rank_pid(1), signal.SIGSTOP)
                stopped_at[name] = time.monotonic()
        except BaseException:
            for job in jobs.values():
                job.process.terminate()  # the launcher ends its ranks
            raise
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            ends = {name: pool.submit(job.finish, COMM_TIMEOUT_S * 5)
                    for name, job in jobs.items()}
        cls.ended = {}
        for name, job in jobs.items():
            status, stderr, _ = ends[name].result()
            cls.ended[name] = (job, status, stderr, job.ended_at - stopped_at[name])

    def assert_stopped_rank_ended_the_job(self, name):
        job, status, stderr, seconds = self.ended[name]
        self.assertEqual(job.leftovers(), [])
        self.assertEqual(status, 3, stderr)
        self.assertLess(seconds, COMM_TIMEOUT_S + GRACE_S, stderr)
        self.assertGreater(seconds, COMM_TIMEOUT_S - 1, stderr)
        # The request's deadline ("did not complete within") or, inside a
        # shared-memory collective, the wait for the peer ("rank 1 ... did
        # not arrive within"): which comes first depends on the step's timing.
        self.assertRegex(stderr, r"(?m)^meshrun: error: rank 0: .*(send|recv|all_reduce|"
                                 r"all_to_all|all_gather|reduce_scatter|broadcast).*did not "
                                 r"(complete|arrive) within")
        self.assertEqual(stderr.splitlines()[-1], "meshrun: error: rank 0 exited with status 3")

    def test_stopped_rank_ends_a_pipeline_within_the_timeout(self):
        self.assert_stopped_rank_ended_the_job("pipeline")

    def test_stopped_rank_ends_data_parallel_within_the_timeout(self):
        self.assert_stopped_rank_ended_the_job("fsdp2")

    def test_stopped_rank_ends_context_parallel_within_the_timeout(self):
        # Ring attention's transfers are in flight when the peer stops.
        self.assert_stopped_rank_ended_the_job("cp2")


class Interrupts(TrainTest):
    def assert_interrupt_ends_the_job(self, name, nproc, *overrides):
        job = Job(self.runs, name, nproc, *overrides)
        job.wait_for_steps()
        job.process.send_signal(signal.SIGINT)
        status, stderr, seconds = job.finish()
        self.assertEqual(job.leftovers(), [])
        self.assertEqual(status, 130, stderr)
        self.assertLess(seconds, 10, stderr)
        self.assertEqual(stderr.splitlines()[-1],
                         "meshrun: error: interrupted by SIGINT; the job was stopped")

    def test_sigint_ends_every_rank(self):
        self.assert_interrupt_ends_the_job("sigint-pipeline", 2, *PIPELINE)

    def test_sigint_ends_a_single_rank(self):
        self.assert_interrupt_ends_the_job("sigint-one", 1)

    def test_timeout_ends_the_job(self):
        for nproc in (1, 2):
            with self.subTest(nproc=nproc):
                result, _ = train(self.runs, "timeout-%d" % nproc, nproc, *ENDLESS,
                                  "--timeout", "4")
                self.assertEqual(result.returncode, 124, result.stderr)
                self.assertIn("meshrun: error: the job timed out after 4 s", result.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)
