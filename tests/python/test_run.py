"""Runtime.train (the host API's meshrun_run_train) against `meshrun train`.

- The same run: llama-tiny (seq 64, 4 steps, fsdp2 bfloat16) on 2 ranks,
  once by `meshrun train` and once by two Python ranks under `meshrun
  launch` calling Runtime.train. The same config, ranks, data and kernels
  compute the same numbers, so every step's loss, gradient norm and
  learning rate must be equal bit for bit (exact equality: any difference
  is a different computation, not rounding); each rank's on_step saw every
  step, rank 0's objects equal to metrics.jsonl's lines; both runs export
  model.safetensors.
- Stopping: on_step returning False after step 2 ends the run after step 2
  on both ranks, with the export written.
- Again: a second Runtime.train on the same joined runtime trains from the
  start again and computes the same numbers bit for bit (the model, the
  strategy and the data are made anew by each call).
- Bad input: a batch size the ranks cannot split raises MeshrunError
  INVALID_ARGUMENT naming train.global_batch_size before anything is
  written, and the process goes on.

Run by ctest: test_run.py MESHRUN_EXE
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import environment, metrics  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
CONFIG = os.path.join(ROOT, "examples", "llama-tiny.toml")
OVERRIDES = ["train.steps=4", "data.seq_len=64", "train.val_every=2"]


def callbacks(output, rank):
    with open(os.path.join(output + ".callbacks", f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


class RunTrain(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="meshrun-run-train-")

    def python_run(self, name, stop_at, *overrides):
        output = os.path.join(self.root, name)
        os.makedirs(output + ".callbacks")
        result = subprocess.run(
            [MESHRUN, "launch", "--nproc-per-node", "2", "--", sys.executable,
             os.path.join(HERE, "run_rank.py"), CONFIG, output, str(stop_at), *OVERRIDES,
             *overrides],
            capture_output=True, text=True, timeout=300, env=environment(PYTHONPATH=os.path.join(ROOT, "python")))
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        return output, result.stdout

    def test_same_numbers_as_meshrun_train(self):
        cli = os.path.join(self.root, "cli")
        result = subprocess.run([MESHRUN, "train", CONFIG, "--nproc-per-node", "2", "--output",
                                 cli, *OVERRIDES], capture_output=True, text=True, timeout=300,
                                env=environment(PYTHONPATH=os.path.join(ROOT, "python")))
        self.assertEqual(result.returncode, 0, result.stderr)
        output, _ = self.python_run("python", 0)
        expected, got = metrics(cli), metrics(output)
        self.assertEqual(len(got), 4)
        for key in ("step", "loss", "grad_norm", "lr", "val_loss"):
            self.assertEqual([m.get(key) for m in got], [m.get(key) for m in expected], key)
        self.assertEqual(callbacks(output, 0), got)
        self.assertEqual([m["step"] for m in callbacks(output, 1)], [1, 2, 3, 4])
        for run in (cli, output):
            self.assertTrue(os.path.exists(os.path.join(run, "model.safetensors")), run)

    def test_on_step_stops_every_rank(self):
        output, _ = self.python_run("stopped", 2)
        self.assertEqual([m["step"] for m in metrics(output)], [1, 2])
        for rank in (0, 1):
            self.assertEqual([m["step"] for m in callbacks(output, rank)], [1, 2])
        self.assertTrue(os.path.exists(os.path.join(output, "model.safetensors")))

    def test_a_second_run_on_one_runtime_repeats_the_first(self):
        output, _ = self.python_run("twice", 0, "--twice")
        first, second = metrics(output), metrics(output + ".again")
        self.assertEqual(len(first), 4)
        for key in ("loss", "grad_norm", "lr"):
            self.assertEqual([m[key] for m in second], [m[key] for m in first], key)
        self.assertEqual(len(callbacks(output, 0)), 8)

    def test_bad_input_is_an_error_not_an_exit(self):
        output, stdout = self.python_run("refused", 0, "train.global_batch_size=6")
        for rank in (0, 1):
            self.assertIn(f"rank {rank} refused: 1 INVALID_ARGUMENT", stdout)
            self.assertIn(f"rank {rank} alive", stdout)
        self.assertIn("train.global_batch_size", stdout)
        self.assertFalse(os.path.exists(os.path.join(output, "metrics.jsonl")))

    # A CUDA run joins MPI's world, then starts NCCL's on the rank's GPU:
    # without one the join says so, naming the rank, and the process goes on.
    @unittest.skipIf(os.path.exists("/dev/nvidia0"), "this machine has a GPU")
    def test_a_cuda_join_without_a_gpu_names_the_rank(self):
        script = ("import sys, meshrun\n"
                  "try:\n"
                  "    meshrun.init(sys.argv[1], overrides=['dist_env.backend=nccl'])\n"
                  "except meshrun.MeshrunError as error:\n"
                  "    print(f'refused: {error.code} {error}', flush=True)\n")
        result = subprocess.run(
            [MESHRUN, "launch", "--nproc-per-node", "2", "--", sys.executable, "-c", script,
             CONFIG], capture_output=True, text=True, timeout=120,
            env=environment(PYTHONPATH=os.path.join(ROOT, "python")))
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        for rank in (0, 1):
            self.assertIn(f"rank {rank}: dist_env.backend = \"nccl\" and this process sees no "
                          "usable CUDA device", result.stdout)
        self.assertEqual(result.stdout.count("refused: 8 UNAVAILABLE"), 2, result.stdout)


if __name__ == "__main__":
    MESHRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
