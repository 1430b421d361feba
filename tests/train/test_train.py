"""`meshrun train` as a user runs it, on a tiny Llama so the file runs fast.

Run by ctest: test_train.py MESHRUN_EXE [TestClass ...]

Tolerances: runs that differ in world size or micro-batching see the same
sequences and compute in float32; only the order in which per-sequence
gradients are summed and averaged differs (within a micro-batch, across
micro-batches, across ranks). Those roundings (~1e-7 relative) pass through
a few AdamW steps, so losses agree to a relative 1e-4, not bit for bit.
Resuming on the same world size repeats the same operations in the same
order, so its losses must be identical.
"""

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import InputErrorAssertions  # noqa: E402

MESHRUN = sys.argv[1] if len(sys.argv) > 1 else "meshrun"
TOLERANCE = 1e-4

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
val_every = 2
seed = 7

[distributed]
strategy = "ddp"
"""


def run(*args, timeout=60):
    return subprocess.run([MESHRUN, "train", *args], capture_output=True, text=True,
                          errors="replace", timeout=timeout)


class Runs:
    """A temporary folder holding the tiny config and one folder per run."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="meshrun-train-test-")
        self.config = os.path.join(self.root, "tiny.toml")
        with open(self.config, "w") as f:
            f.write(TINY)

    def train(self, name, nproc, *overrides):
        output = os.path.join(self.root, name)
        result = run(self.config, "--nproc-per-node", str(nproc), "--output", output, *overrides)
        if result.returncode != 0:
            raise AssertionError(f"run {name} failed ({result.returncode}):\n"
                                 f"{result.stdout}\n{result.stderr}")
        return output

    def cleanup(self):
        shutil.rmtree(self.root, ignore_errors=True)


def metrics(output):
    with open(os.path.join(output, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(output):
    return [m["loss"] for m in metrics(output)]


def safetensors_header(path):
    with open(path, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(length))


class TrainTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.runs = Runs()

    @classmethod
    def tearDownClass(cls):
        cls.runs.cleanup()

    def assert_close(self, expected, actual):
        self.assertEqual(len(expected), len(actual))
        for step, (a, b) in enumerate(zip(expected, actual), 1):
            self.assertLessEqual(abs(a - b), TOLERANCE * abs(a), f"step {step}: {a} vs {b}")


class Equivalence(TrainTest):
    def test_four_ranks_match_one_rank(self):
        one = self.runs.train("ddp1", 1)
        four = self.runs.train("ddp4", 4)
        self.assert_close(losses(one), losses(four))
        val_one = [m["val_loss"] for m in metrics(one) if "val_loss" in m]
        val_four = [m["val_loss"] for m in metrics(four) if "val_loss" in m]
        self.assertEqual(len(val_one), 2)  # every 2 steps, the last included
        self.assert_close(val_one, val_four)

    def test_gradient_accumulation(self):
        whole = self.runs.train("micro4", 1, "train.micro_batch_size=4")
        single = self.runs.train("micro1", 1, "train.micro_batch_size=1")
        two_ranks = self.runs.train("micro2x2", 2, "train.micro_batch_size=2")
        self.assert_close(losses(whole), losses(single))
        self.assert_close(losses(whole), losses(two_ranks))

    def test_metrics_lines(self):
        output = self.runs.train("metrics", 2, "train.steps=2")
        lines = metrics(output)
        self.assertEqual([m["step"] for m in lines], [1, 2])
        for m in lines:
            for key in ("loss", "tokens_per_s", "step_time_s", "lr", "grad_norm"):
                self.assertGreater(m[key], 0, key)
            for key in ("params", "grads", "optimizer", "buffers", "peak_rss"):
                self.assertGreaterEqual(m["mem"][key], 0, key)
            self.assertEqual(m["mem"]["optimizer"], 2 * m["mem"]["params"])
        self.assertIn("val_loss", lines[-1])


class Checkpoints(TrainTest):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.full = cls.runs.train("full2", 2, "checkpoint.save_every=2")
        cls.step2 = os.path.join(cls.full, "checkpoints", "step_2")

    def resume(self, name, nproc):
        return self.runs.train(name, nproc, "checkpoint.save_every=2",
                               f"checkpoint.resume_from={self.step2}")

    def test_resume_into_its_own_folder_continues_the_metrics(self):
        own = os.path.join(self.runs.root, "own2")
        shutil.copytree(self.full, own)
        self.runs.train("own2", 2,
                        f"checkpoint.resume_from={os.path.join(own, 'checkpoints', 'step_2')}")
        self.assertEqual([m["step"] for m in metrics(own)], [1, 2, 3, 4])
        self.assertEqual(losses(self.full), losses(own))

    def test_resume_is_exact_on_the_same_world_size(self):
        resumed = self.resume("resume2", 2)
        self.assertEqual([m["step"] for m in metrics(resumed)], [3, 4])
        self.assertEqual(losses(self.full)[2:], losses(resumed))
        with open(os.path.join(self.full, "model.safetensors"), "rb") as a, \
                open(os.path.join(resumed, "model.safetensors"), "rb") as b:
            self.assertEqual(a.read(), b.read())

    def test_sharded_checkpoint_loads_on_other_world_sizes(self):
        with open(os.path.join(self.step2, "index.json")) as f:
            index = json.load(f)
        self.assertEqual((index["step"], index["world_size"]), (2, 2))
        self.assertEqual(index["slices"][-1]["end"], index["numel"])
        for nproc in (1, 4):
            resumed = self.resume(f"resume{nproc}", nproc)
            self.assert_close(losses(self.full)[2:], losses(resumed))

    def test_export_has_hugging_face_names_and_shapes(self):
        header = safetensors_header(os.path.join(self.full, "model.safetensors"))
        self.assertEqual(header.pop("__metadata__"), {"format": "pt"})
        expected = {"model.embed_tokens.weight": [256, 32], "model.norm.weight": [32],
                    "lm_head.weight": [256, 32]}
        for n in range(2):
            p = f"model.layers.{n}."
            expected.update({p + "input_layernorm.weight": [32],
                             p + "self_attn.q_proj.weight": [32, 32],
                             p + "self_attn.k_proj.weight": [16, 32],
                             p + "self_attn.v_proj.weight": [16, 32],
                             p + "self_attn.o_proj.weight": [32, 32],
                             p + "post_attention_layernorm.weight": [32],
                             p + "mlp.gate_proj.weight": [64, 32],
                             p + "mlp.up_proj.weight": [64, 32],
                             p + "mlp.down_proj.weight": [32, 64]})
        self.assertEqual({name: t["shape"] for name, t in header.items()}, expected)
        self.assertEqual({t["dtype"] for t in header.values()}, {"F32"})
        with open(os.path.join(self.full, "config.json")) as f:
            config = json.load(f)
        self.assertEqual(config["architectures"], ["LlamaForCausalLM"])
        self.assertEqual((config["hidden_size"], config["num_key_value_heads"]), (32, 2))

    def test_export_reloads(self):
        # A step with a learning rate too small to move float32 weights: the
        # val_loss after it is the exported model's.
        reloaded = self.runs.train("reload", 2, f"model.checkpoint={self.full}",
                                   "train.steps=1", "train.lr=1e-30", "train.min_lr=0",
                                   "train.weight_decay=0")
        self.assertEqual(metrics(self.full)[-1]["val_loss"], metrics(reloaded)[-1]["val_loss"])

    def test_bfloat16_export(self):
        output = self.runs.train("bf16", 1, "train.steps=1", "model.torch_dtype=bfloat16")
        header = safetensors_header(os.path.join(output, "model.safetensors"))
        header.pop("__metadata__")
        self.assertEqual({t["dtype"] for t in header.values()}, {"BF16"})
        with open(os.path.join(output, "config.json")) as f:
            self.assertEqual(json.load(f)["torch_dtype"], "bfloat16")


class BadInput(TrainTest, InputErrorAssertions):
    def assert_bad_training_input(self, key, *overrides, nproc=2):
        result = run(self.runs.config, "--nproc-per-node", str(nproc),
                     "--output", os.path.join(self.runs.root, "bad"), *overrides)
        self.assert_input_error(result, key)
        self.assertFalse(os.path.exists(os.path.join(self.runs.root, "bad")))

    def test_missing_data_file(self):
        self.assert_bad_training_input("data.path", "data.path=/nonexistent/text")

    def test_data_fifo_is_refused_without_blocking(self):
        fifo = os.path.join(self.runs.root, "fifo")
        os.mkfifo(fifo)
        self.assert_bad_training_input("data.path", f"data.path={fifo}")

    def test_data_key_position_is_named(self):
        with open(self.runs.config) as f:
            text = f.read()
        lines = text.splitlines()
        line = next(i for i, l in enumerate(lines, 1) if l.startswith("path ="))
        config = os.path.join(self.runs.root, "missing.toml")
        with open(config, "w") as f:
            f.write(text.replace("/usr/share/common-licenses/GPL-3", "/nonexistent/text"))
        result = run(config)
        self.assertEqual(result.returncode, 2)
        self.assertIn(f"{config}:{line}:1: data.path", result.stderr)

    def test_each_bad_input_names_its_key(self):
        cases = [  # (key the message must name, overrides)
            ("data.seq_len", "data.seq_len=100000"),
            ("train.global_batch_size", "train.global_batch_size=6"),  # 6 % (2 x dp 2)
            ("train.steps", "train.steps=0"),
            ("train.lr", "train.lr=-0.1"),
            ("model.num_attention_heads", "model.num_attention_heads=5",
             "model.num_key_value_heads=5"),
            ("model.num_key_value_heads", "model.num_key_value_heads=3"),
            ("train.stepz", "train.stepz=3"),
            ("model.model_type", "model.model_type=gpt9"),
            # no training entry points
            ("distributed.strategy", "distributed.strategy=megatron_fsdp"),
            ("distributed.tp_size", "distributed.strategy=fsdp2", "distributed.tp_size=2"),
            ("distributed.activation_checkpointing", "distributed.activation_checkpointing=true"),
            ("model.checkpoint", "model.checkpoint=/nonexistent"),
            ("checkpoint.resume_from", "checkpoint.resume_from=/nonexistent"),
        ]
        for key, *overrides in cases:
            with self.subTest(key=key):
                self.assert_bad_training_input(key, *overrides)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)
