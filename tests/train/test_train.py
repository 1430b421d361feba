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
import resource
import shutil
import signal
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


def run(*args, timeout=60, preexec_fn=None):
    return subprocess.run([MESHRUN, "train", *args], capture_output=True, text=True,
                          errors="replace", timeout=timeout, preexec_fn=preexec_fn)


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


def read_safetensors(path):
    """{name: (dtype, shape, raw little-endian bytes)} of a safetensors file."""
    with open(path, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
        data = f.read()
    header.pop("__metadata__", None)
    return {name: (entry["dtype"], entry["shape"],
                   data[entry["data_offsets"][0]:entry["data_offsets"][1]])
            for name, entry in header.items()}


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

    def test_activations_grow_with_the_sequence_not_its_square(self):
        # Attention keeps each row's log-sum-exp, not its probabilities
        # (backward recomputes them): every activation is per token, so 4x
        # the sequence holds exactly 4x.
        held = {}
        for seq_len in (32, 128):
            output = self.runs.train(f"seq{seq_len}", 1, f"data.seq_len={seq_len}",
                                     "train.steps=1", "train.val_every=0")
            held[seq_len] = metrics(output)[0]["mem"]["activations"]
        self.assertEqual(held[128], 4 * held[32])

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
            # no such strategy plugin
            ("distributed.strategy", "distributed.strategy=zero"),
            ("distributed.tp_size", "distributed.strategy=fsdp2", "distributed.tp_size=3"),
            ("model.checkpoint", "model.checkpoint=/nonexistent"),
            ("checkpoint.resume_from", "checkpoint.resume_from=/nonexistent"),
        ]
        for key, *overrides in cases:
            with self.subTest(key=key):
                self.assert_bad_training_input(key, *overrides)

def file_size_limit(limit):
    """A preexec_fn: files the run writes cannot grow past `limit` bytes, and
    a write beyond it fails (EFBIG) instead of raising SIGXFSZ."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def folder_bytes(folder):
    return {name: read_bytes(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


class FullDisk(TrainTest):
    """Every write a run makes is checked: a failed one ends the run with a
    non-zero status naming the file and the bytes missing. /dev/full fails
    every write with ENOSPC; a file-size limit fails writes past it."""

    def assert_fails_naming(self, result, *needles):
        self.assertNotEqual(result.returncode, 0, result.stdout + result.stderr)
        for needle in needles:
            self.assertIn(needle, result.stderr)

    def output_with_full_file(self, name, file):
        output = os.path.join(self.runs.root, name)
        os.makedirs(output)
        os.symlink("/dev/full", os.path.join(output, file))
        return output

    def test_metrics_on_a_full_disk(self):
        output = self.output_with_full_file("full-metrics", "metrics.jsonl")
        result = run(self.runs.config, "--nproc-per-node", "2", "--output", output)
        self.assert_fails_naming(result, f"cannot write '{output}/metrics.jsonl'",
                                 "bytes missing, 0 written (No space left on device)")

    def test_config_json_on_a_full_disk(self):
        output = self.output_with_full_file("full-config", "config.json.partial")
        result = run(self.runs.config, "--nproc-per-node", "2", "--output", output,
                     "train.steps=1")
        self.assert_fails_naming(result, f"cannot write '{output}/config.json'",
                                 "bytes missing, 0 written (No space left on device)")
        self.assertFalse(os.path.exists(os.path.join(output, "config.json")))

    def test_a_failed_resave_leaves_the_last_checkpoint_intact(self):
        # A wider model, so that its shards (10 MB) do not fit an 8 MiB limit
        # that MPI's own shared-memory files (PMIx) still fit.
        wider = ("checkpoint.save_every=2", "model.hidden_size=256",
                 "model.intermediate_size=768", "model.num_attention_heads=8",
                 "model.num_key_value_heads=4")
        output = self.runs.train("resave", 2, *wider)
        step2 = os.path.join(output, "checkpoints", "step_2")
        step4 = os.path.join(output, "checkpoints", "step_4")
        before = folder_bytes(step4)
        # Resuming at step 2 saves step 4 again.
        result = run(self.runs.config, "--nproc-per-node", "2", "--output", output, *wider,
                     f"checkpoint.resume_from={step2}",
                     preexec_fn=file_size_limit(8 * 1024 * 1024))
        self.assert_fails_naming(result, "step_4.partial/shard_", "bytes missing, 8388608 written",
                                 "(File too large)")
        self.assertEqual(before, folder_bytes(step4))
        self.runs.train("resave-resumed", 1, *wider, f"checkpoint.resume_from={step4}")


class CorruptCheckpoints(TrainTest, InputErrorAssertions):
    """Each corruption of a real checkpoint is refused with a message naming
    the file and the check that caught it."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.saved = cls.runs.train("saved", 2, "checkpoint.save_every=2", "train.steps=2")
        cls.other = cls.runs.train("other", 2, "checkpoint.save_every=2", "train.steps=2",
                                   "train.lr=1e-3")

    def corrupted(self, name, change):
        """A copy of the saved step_2 that `change(folder, index)` altered;
        the index it returns is written back."""
        folder = os.path.join(self.runs.root, name)
        shutil.copytree(os.path.join(self.saved, "checkpoints", "step_2"), folder)
        path = os.path.join(folder, "index.json")
        with open(path) as f:
            index = json.load(f)
        index = change(folder, index)
        with open(path, "w") as f:
            json.dump(index, f)
        return folder

    def resume(self, folder):
        output = os.path.join(self.runs.root, "out-" + os.path.basename(folder))
        return run(self.runs.config, "--output", output,
                   "train.steps=3", f"checkpoint.resume_from={folder}")

    def test_another_model_is_refused_naming_the_parameter(self):
        folder = os.path.join(self.saved, "checkpoints", "step_2")
        output = os.path.join(self.runs.root, "out-wider-mlp")
        result = run(self.runs.config, "--output", output, "train.steps=3",
                     "model.intermediate_size=96", f"checkpoint.resume_from={folder}")
        self.assert_input_error(result, "checkpoint.resume_from",
                                f"'{folder}' holds parameter 'model.layers.0.mlp.gate_proj.weight' "
                                "with ")

    def test_a_rank_left_out_of_the_index(self):
        def drop_rank_1(folder, index):
            index["slices"] = [s for s in index["slices"] if s["rank"] != 1]
            return index
        folder = self.corrupted("no-rank-1", drop_rank_1)
        self.assert_input_error(self.resume(folder), "checkpoint.resume_from",
                                f"{folder}/index.json: no slice holds elements [",
                                "a rank's slices are missing")

    def test_shards_swapped(self):
        def swap(folder, index):
            a, b = (os.path.join(folder, f"shard_{r}.safetensors") for r in (0, 1))
            os.rename(a, a + ".tmp")
            os.rename(b, a)
            os.rename(a + ".tmp", b)
            return index
        folder = self.corrupted("swapped", swap)
        self.assert_input_error(self.resume(folder), "checkpoint.resume_from",
                                f"{folder}/shard_0.safetensors: its __metadata__ has "
                                "meshrun.rank = 1, index.json expects 0 (the ownership check")

    def test_a_slice_naming_a_missing_part(self):
        def part_7(folder, index):
            index["slices"][0]["part"] = 7
            return index
        folder = self.corrupted("part-7", part_7)
        self.assert_input_error(self.resume(folder), "checkpoint.resume_from",
                                f"{folder}/index.json: slice 0 (shard_0.safetensors part 7",
                                f"needs tensor 'params.7', which {folder}/shard_0.safetensors "
                                "does not hold")

    def test_an_index_without_checksums(self):
        def old_format(folder, index):
            del index["format_version"]
            return index
        folder = self.corrupted("old-format", old_format)
        self.assert_input_error(self.resume(folder), "checkpoint.resume_from",
                                f"{folder}/index.json: no \"format_version\": 2")

    def assert_checksum_refused(self, folder, file):
        result = self.resume(folder)
        self.assertNotEqual(result.returncode, 0, result.stderr)
        self.assertIn(f"{folder}/{file}: XXH3-64 checksum ", result.stderr)
        self.assertIn("(the checksum check: the file changed after it was saved)", result.stderr)

    def test_nan_written_into_a_shard(self):
        def write_nan(folder, index):
            path = os.path.join(folder, "shard_1.safetensors")
            data = bytearray(read_bytes(path))
            data[-4:] = struct.pack("<f", float("nan"))
            with open(path, "wb") as f:
                f.write(data)
            return index
        folder = self.corrupted("nan", write_nan)
        self.assert_checksum_refused(folder, "shard_1.safetensors")

    def test_old_and_new_shards_mixed(self):
        # What a save killed half way used to leave: the old index beside a
        # shard of another save (same rank, step and size).
        def mix(folder, index):
            shutil.copy(os.path.join(self.other, "checkpoints", "step_2", "shard_1.safetensors"),
                        folder)
            return index
        folder = self.corrupted("mixed", mix)
        self.assert_checksum_refused(folder, "shard_1.safetensors")

    def test_a_save_leaves_no_partial_folder(self):
        checkpoints = os.path.join(self.saved, "checkpoints")
        self.assertEqual(os.listdir(checkpoints), ["step_2"])
        with open(os.path.join(checkpoints, "step_2", "index.json")) as f:
            index = json.load(f)
        self.assertEqual([(f["file"], f["rank"]) for f in index["files"]],
                         [("shard_0.safetensors", 0), ("shard_1.safetensors", 1)])

    def exported_copy(self, name, change_header, change_data=lambda data: data):
        folder = os.path.join(self.runs.root, name)
        os.makedirs(folder)
        shutil.copy(os.path.join(self.saved, "config.json"), folder)
        raw = read_bytes(os.path.join(self.saved, "model.safetensors"))
        length = struct.unpack("<Q", raw[:8])[0]
        header = change_header(json.loads(raw[8:8 + length]))
        text = json.dumps(header).encode()
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + change_data(raw[8 + length:]))
        return folder

    def test_export_with_a_bf16_label_on_float32_bytes(self):
        def relabel(header):
            header["model.norm.weight"]["dtype"] = "BF16"
            return header
        folder = self.exported_copy("bf16-label", relabel)
        result = run(self.runs.config, "--output", os.path.join(self.runs.root, "out-bf16"),
                     f"model.checkpoint={folder}")
        self.assert_input_error(result, "model.checkpoint",
                                "tensor 'model.norm.weight' has data_offsets",
                                "in BF16 needs 32 elements x 2 bytes")

    def test_export_with_nan_weights(self):
        def write_nan(data):
            return struct.pack("<f", float("nan")) + data[4:]
        folder = self.exported_copy("nan-export", lambda header: header, write_nan)
        result = run(self.runs.config, "--output", os.path.join(self.runs.root, "out-nan"),
                     f"model.checkpoint={folder}")
        self.assertNotEqual(result.returncode, 0, result.stderr)
        self.assertIn(f"{folder}/model.safetensors: tensor ", result.stderr)
        self.assertIn("holds nan at element 0; weights must be finite", result.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)
