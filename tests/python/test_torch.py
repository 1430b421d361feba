"""meshrun.torch and examples/python/train_torch.py as a user runs them, under
`meshrun launch`, on tiny models so that each class runs in well under a
minute on 2 cores.

Run by ctest: test_torch.py MESHRUN_EXE [TestClass ...]

Tolerances. Runs that differ in world size, micro-batching or strategy see
the same sequences and compute in float32 (fsdp2 with param_dtype float32);
only the order in which gradients are summed and averaged differs, and the
order of the squared norm for clipping. Those roundings (~1e-7 relative)
pass through a few AdamW steps: losses agree to a relative 1e-4 (as
tests/train/test_train.py's), parameters to an absolute 1e-5 (they are of
order 0.02 to 1; AdamW moves each by at most lr = 1e-2 a step). Loading a
checkpoint restores parameters bit for bit on any world size or strategy.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy

MESHRUN = sys.argv[1] if len(sys.argv) > 1 else "meshrun"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
TORCH_RANK = os.path.join(HERE, "torch_rank.py")
TRAIN_TORCH = os.path.join(ROOT, "examples", "python", "train_torch.py")
LOSS_TOLERANCE = 1e-4
PARAMETER_TOLERANCE = 1e-5
FLOAT32_FSDP2 = ("distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=float32")
DDP = ("distributed.strategy=ddp",)

TINY = """
[model]
model_type = "llama"
vocab_size = 256
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2

[data]
path = "/usr/share/common-licenses/GPL-3"
seq_len = 32
val_fraction = 0.05

[train]
steps = 4
global_batch_size = 8
micro_batch_size = 2
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
seed = 7

[comm]
timeout_minutes = 1
"""


def launch(nproc, *command, timeout=120):
    """Runs `command` on nproc ranks through `meshrun launch`; fails the
    test with the output unless every rank succeeded."""
    result = subprocess.run([MESHRUN, "launch", "--nproc-per-node", str(nproc), "--",
                             sys.executable, *command], capture_output=True, text=True,
                            errors="replace", timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{command[0]} on {nproc} ranks failed ({result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


class Folder:
    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="meshrun-python-test-")

    def path(self, *parts):
        return os.path.join(self.root, *parts)

    def cleanup(self):
        shutil.rmtree(self.root, ignore_errors=True)


class Case(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.folder = Folder()

    @classmethod
    def tearDownClass(cls):
        cls.folder.cleanup()

    def assert_losses_close(self, expected, actual):
        self.assertEqual(len(expected), len(actual))
        for step, (a, b) in enumerate(zip(expected, actual), 1):
            self.assertLessEqual(abs(a - b), LOSS_TOLERANCE * abs(a), f"step {step}: {a} vs {b}")


class Wrapper(Case):
    """meshrun.torch.DistributedModule: the checks of torch_rank.py on every
    rank, then fsdp2 against ddp, and checkpoints across world sizes and
    strategies."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.runs = {}
        for name, nproc, overrides in (("ddp2", 2, DDP), ("fsdp2_2", 2, FLOAT32_FSDP2)):
            launch(nproc, TORCH_RANK, "--output", cls.folder.path(name), "--save-at", "2",
                   *overrides)
            cls.runs[name] = cls.folder.path(name)

    def params(self, run, step):
        return numpy.load(os.path.join(run, f"params_step{step}.npy"))

    def result(self, run):
        with open(os.path.join(run, "result.json")) as f:
            return json.load(f)

    def test_fsdp2_parameters_equal_ddp_parameters(self):
        ddp, fsdp2 = self.runs["ddp2"], self.runs["fsdp2_2"]
        self.assertFalse(self.result(ddp)["sharded"])
        self.assertTrue(self.result(fsdp2)["sharded"])
        self.assert_losses_close(self.result(ddp)["losses"], self.result(fsdp2)["losses"])
        for step in (1, 2, 3):
            numpy.testing.assert_allclose(self.params(fsdp2, step), self.params(ddp, step),
                                          rtol=0, atol=PARAMETER_TOLERANCE)
        self.assertFalse(numpy.array_equal(self.params(ddp, 1), self.params(ddp, 3)))

    def test_checkpoints_load_on_other_world_sizes_and_strategies(self):
        for saved, nproc, overrides in (("fsdp2_2", 1, DDP), ("ddp2", 4, FLOAT32_FSDP2)):
            with self.subTest(saved=saved, nproc=nproc):
                output = self.folder.path(f"load_{saved}_{nproc}")
                launch(nproc, TORCH_RANK, "--output", output, "--load",
                       os.path.join(self.runs[saved], "checkpoint"), *overrides)
                numpy.testing.assert_array_equal(self.params(output, 2),
                                                 self.params(self.runs[saved], 2))
                # The optimizer's moments came along: the next step matches.
                numpy.testing.assert_allclose(self.params(output, 3),
                                              self.params(self.runs[saved], 3),
                                              rtol=0, atol=PARAMETER_TOLERANCE)
                self.assert_losses_close(self.result(self.runs[saved])["losses"][2:],
                                         self.result(output)["losses"])


def metrics(output):
    with open(os.path.join(output, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(output):
    return [m["loss"] for m in metrics(output)]


class TrainTorch(Case):
    """examples/python/train_torch.py: one global batch, any number of ranks."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.config = cls.folder.path("tiny.toml")
        with open(cls.config, "w") as f:
            f.write(TINY)

    def train(self, strategy, nproc, *overrides):
        """The run's output folder; a run already made is reused."""
        output = self.folder.path("_".join((strategy, str(nproc)) + overrides))
        if not os.path.exists(output):
            launch(nproc, TRAIN_TORCH, self.config, "--strategy", strategy, "--output", output,
                   *overrides)
        return output

    def test_one_two_and_four_ranks_compute_the_same_losses(self):
        reference = None
        for strategy, overrides in (("ddp", ()), ("fsdp2", ("--param-dtype", "float32"))):
            for nproc in (1, 2, 4):
                with self.subTest(strategy=strategy, nproc=nproc):
                    run = losses(self.train(strategy, nproc, *overrides))
                    reference = reference or run
                    self.assert_losses_close(reference, run)
        self.assertLess(reference[-1], reference[0])

    def test_torch_ddp_runs_and_agrees(self):
        output = self.train("torch_ddp", 2)
        lines = metrics(output)
        self.assertEqual([m["step"] for m in lines], [1, 2, 3, 4])
        for m in lines:
            for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"):
                self.assertGreater(m[key], 0, key)
        self.assertLess(lines[-1]["loss"], lines[0]["loss"])
        # The same model, data and optimizer rules: PyTorch's DDP agrees with meshrun's.
        self.assert_losses_close(losses(self.train("ddp", 2)), [m["loss"] for m in lines])

    def test_strategies_interleaved_in_one_run(self):
        """Two meshrun runtimes and PyTorch's process group in one process:
        each strategy computes what it computes alone."""
        output = self.train("ddp,fsdp2,torch_ddp,torch_nosync", 2, "--param-dtype", "float32",
                            "train.steps=2")
        alone = losses(self.train("ddp", 2))[:2]
        for strategy in ("ddp", "fsdp2", "torch_ddp"):
            lines = metrics(os.path.join(output, strategy))
            self.assertEqual([m["step"] for m in lines], [1, 2])
            self.assert_losses_close(alone, [m["loss"] for m in lines])
            for m in lines:
                self.assertLess(m.get("strategy_s", 0), m["step_time_s"])
        # Without the all-reduce each rank's replica follows its own slice.
        nosync = losses(os.path.join(output, "torch_nosync"))
        self.assertEqual(nosync[0], alone[0])
        self.assertNotEqual(nosync[1], alone[1])


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)
