"""meshrun from Rust, both sides of the ABI, against the shipped C++.

- The Rust host (bindings/rust/meshrun/examples/train_llama.rs, through
  meshrun_run_train) against `meshrun train`: llama-tiny (seq 64, 4 steps)
  on 2 ranks each. The same config on the same ranks computes the same
  numbers, so every step's loss, gradient norm and validation loss must be
  equal bit for bit, and the host prints each step's loss as metrics.jsonl
  has it. Bad input ends it with the library's INVALID_ARGUMENT naming the
  key.
- The safe wrapper's collectives (examples/collectives.rs) on 2 and 3
  ranks: all_reduce (sum, max, a started average), all_gather,
  reduce_scatter, broadcast, all_to_all with uneven counts (and a wrong
  number of counts refused), a ring of started sends and receives, and a
  barrier, for f32, i32 and i64, each rank checking the values it can
  compute alone.
- The Rust strategy plugin rust_ddp (bindings/rust/rust_ddp), installed as
  meshrun_strategy_rust_ddp.so in a folder of MESHRUN_PLUGIN_PATH: it
  passes the conformance suite, and `meshrun train ...
  distributed.strategy=rust_ddp` on 2 ranks trains bit-identically to
  `distributed.strategy=ddp` (6 steps, two micro-batches a step: every
  loss and gradient norm equal, and the exported model.safetensors equal
  byte for byte).

Run by ctest after `cargo test` built them:
    test_rust.py MESHRUN_EXE CONFORMANCE_EXE TRAIN_LLAMA_EXE LIBRUST_DDP_SO
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import environment, metrics, same_export  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CONFIG = os.path.join(ROOT, "examples", "llama-tiny.toml")
OVERRIDES = ["train.steps=4", "data.seq_len=64", "train.val_every=2"]


class RustHost(unittest.TestCase):
    def test_same_numbers_as_meshrun_train(self):
        root = tempfile.mkdtemp(prefix="meshrun-rust-host-")
        cli, rust = os.path.join(root, "cli"), os.path.join(root, "rust")
        result = subprocess.run([MESHRUN, "train", CONFIG, "--nproc-per-node", "2", "--output",
                                 cli, *OVERRIDES], capture_output=True, text=True, timeout=300,
                                env=environment())
        self.assertEqual(result.returncode, 0, result.stderr)
        result = subprocess.run([MESHRUN, "launch", "--nproc-per-node", "2", "--", TRAIN_LLAMA,
                                 CONFIG, rust, *OVERRIDES], capture_output=True, text=True,
                                timeout=300, env=environment())
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        expected, got = metrics(cli), metrics(rust)
        self.assertEqual(len(got), 4)
        for key in ("step", "loss", "grad_norm", "lr", "val_loss"):
            self.assertEqual([m.get(key) for m in got], [m.get(key) for m in expected], key)
        printed = [line.split("loss ")[1] for line in result.stdout.splitlines()
                   if line.startswith("rust host: 2 ranks, loss ")]
        self.assertEqual([float(loss) for loss in printed], [m["loss"] for m in got])
        self.assertTrue(os.path.exists(os.path.join(rust, "model.safetensors")))

    def test_bad_input_ends_the_run_naming_the_key(self):
        result = subprocess.run([MESHRUN, "launch", "--nproc-per-node", "2", "--", TRAIN_LLAMA,
                                 CONFIG, tempfile.mkdtemp(), "train.global_batch_size=6"],
                                capture_output=True, text=True, timeout=300, env=environment())
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("train_llama: INVALID_ARGUMENT", result.stderr)
        self.assertIn("train.global_batch_size", result.stderr)


class RustComm(unittest.TestCase):
    def test_every_collective_on_2_and_3_ranks(self):
        collectives = os.path.join(os.path.dirname(TRAIN_LLAMA), "collectives")
        for ranks in (2, 3):
            result = subprocess.run([MESHRUN, "launch", "--nproc-per-node", str(ranks), "--",
                                     collectives, CONFIG], capture_output=True, text=True,
                                    timeout=120, env=environment())
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            for rank in range(ranks):
                self.assertIn(f"collectives: rank {rank} of {ranks} ok", result.stdout)


class RustDdp(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="meshrun-rust-ddp-")
        cls.plugins = os.path.join(cls.root, "plugins")
        os.makedirs(cls.plugins)
        cls.plugin = os.path.join(cls.plugins, "meshrun_strategy_rust_ddp.so")
        shutil.copy(RUST_DDP, cls.plugin)

    def test_passes_the_conformance_suite(self):
        result = subprocess.run([CONFORMANCE, "--plugin", self.plugin], capture_output=True,
                                text=True, timeout=300, env=environment())
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_trains_bit_identically_to_ddp(self):
        env = dict(environment(), MESHRUN_PLUGIN_PATH=self.plugins)
        runs = {}
        for strategy in ("ddp", "rust_ddp"):
            output = os.path.join(self.root, strategy)
            result = subprocess.run(
                [MESHRUN, "train", CONFIG, "--nproc-per-node", "2", "--output", output,
                 "train.steps=6", "data.seq_len=64", "train.micro_batch_size=2",
                 "train.global_batch_size=8", f"distributed.strategy={strategy}"],
                capture_output=True, text=True, timeout=300, env=env)
            self.assertEqual(result.returncode, 0, result.stderr)
            runs[strategy] = output
        ddp, rust = metrics(runs["ddp"]), metrics(runs["rust_ddp"])
        self.assertEqual(len(rust), 6)
        for key in ("loss", "grad_norm"):
            self.assertEqual([m[key] for m in rust], [m[key] for m in ddp], key)
        self.assertTrue(same_export(runs["ddp"], runs["rust_ddp"]), "the exported weights differ")


if __name__ == "__main__":
    RUST_DDP = sys.argv.pop(4)
    TRAIN_LLAMA = sys.argv.pop(3)
    CONFORMANCE = sys.argv.pop(2)
    MESHRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
