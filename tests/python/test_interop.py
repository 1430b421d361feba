"""A checkpoint of `meshrun train`'s shipped Llama in PyTorch and back.

`meshrun train` trains llama-tiny (seq 64) for 4 steps on 2 ranks, saving
the sharded checkpoint of step 4 and exporting model.safetensors. Two
Python ranks (interop_rank.py) load that checkpoint into the PyTorch Llama
of examples/python/torch_llama.py (the same Hugging Face names) under
meshrun.torch fsdp2: every parameter equals the export bit for bit. They
save it back in meshrun train's format; `meshrun train` resumed from
the Python checkpoint and from its own trains steps 5 and 6 alike: equal
losses and gradient norms bit for bit (the AdamW moments crossed too), and
equal exports byte for byte.

Run by ctest: test_interop.py MESHRUN_EXE
"""

import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshrun_testing import environment, metrics, same_export  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
CONFIG = os.path.join(ROOT, "examples", "llama-tiny.toml")
KEYS = ["data.seq_len=64", "train.val_every=0", "distributed.mp_policy.param_dtype=float32"]


def safetensors(path):
    """{name: float32 array} of a safetensors file (8-byte header length,
    the JSON header, the data)."""
    with open(path, "rb") as f:
        blob = f.read()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + length])
    data = blob[8 + length:]
    arrays = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        assert entry["dtype"] == "F32", entry
        arrays[name] = numpy.frombuffer(data[begin:end], numpy.float32).reshape(entry["shape"])
    return arrays


class Interop(unittest.TestCase):
    def run_ok(self, command):
        result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                                env=environment())
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def train(self, output, *keys):
        self.run_ok([MESHRUN, "train", CONFIG, "--nproc-per-node", "2", "--output", output,
                     *KEYS, *keys])

    def test_train_checkpoint_into_torch_and_back(self):
        root = tempfile.mkdtemp(prefix="meshrun-interop-")
        first = os.path.join(root, "first")
        self.train(first, "train.steps=4", "checkpoint.save_every=4")
        checkpoint = os.path.join(first, "checkpoints", "step_4")
        python_checkpoint = os.path.join(root, "from_python")
        self.run_ok([MESHRUN, "launch", "--nproc-per-node", "2", "--", sys.executable,
                     os.path.join(HERE, "interop_rank.py"), CONFIG, checkpoint,
                     python_checkpoint, *KEYS])

        exported = safetensors(os.path.join(first, "model.safetensors"))
        loaded = dict(numpy.load(python_checkpoint + ".npz"))
        self.assertEqual(sorted(loaded), sorted(exported))
        for name, values in exported.items():
            numpy.testing.assert_array_equal(loaded[name], values, name)
        self.assertTrue(same_export(first, python_checkpoint + ".export"),
                        "Python's export differs from meshrun train's")

        resumed = {}
        for label, source in (("own", checkpoint), ("python", python_checkpoint)):
            resumed[label] = os.path.join(root, f"resumed_{label}")
            self.train(resumed[label], "train.steps=6", f"checkpoint.resume_from={source}")
        own, python = metrics(resumed["own"]), metrics(resumed["python"])
        self.assertEqual([m["step"] for m in python], [5, 6])
        for key in ("loss", "grad_norm", "lr"):
            self.assertEqual([m[key] for m in python], [m[key] for m in own], key)
        self.assertTrue(same_export(resumed["own"], resumed["python"]),
                        "the resumed runs' exports differ")


if __name__ == "__main__":
    MESHRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
