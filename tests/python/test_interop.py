"""A checkpoint of `meshrun train`'s shipped Llama in PyTorch and back.

`meshrun train` trains llama-tiny (seq 64) for 4 steps on 2 ranks, saving
the sharded checkpoint of step 4 and exporting model.safetensors. Two
Python ranks (interop_rank.py) load that checkpoint into the PyTorch Llama
of examples/python/torch_llama.py (the same Hugging Face names) under
meshrun.torch fsdp2: every parameter equals the export bit for bit, whether
the module registers its parameters in Hugging Face's order (each layer's
norms last: the checkpoint finds each parameter by name) or in meshrun's
(then its export is meshrun train's, byte for byte, config.json included).
They save it back in meshrun train's format; `meshrun train` resumed from
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

    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="meshrun-interop-")
        cls.first = os.path.join(cls.root, "first")
        cls.checkpoint = os.path.join(cls.first, "checkpoints", "step_4")
        cls.own = os.path.join(cls.root, "resumed_own")
        for output, keys in ((cls.first, ("train.steps=4", "checkpoint.save_every=4")),
                             (cls.own, ("train.steps=6", f"checkpoint.resume_from={cls.checkpoint}"))):
            result = subprocess.run([MESHRUN, "train", CONFIG, "--nproc-per-node", "2",
                                     "--output", output, *KEYS, *keys],
                                    capture_output=True, text=True, timeout=300,
                                    env=environment())
            assert result.returncode == 0, result.stdout + result.stderr

    def round_trip(self, order):
        """Step 4 into the torch module with its parameters in `order`, back
        out as a checkpoint, and meshrun train resumed from it."""
        python_checkpoint = os.path.join(self.root, f"from_python_{order}")
        self.run_ok([MESHRUN, "launch", "--nproc-per-node", "2", "--", sys.executable,
                     os.path.join(HERE, "interop_rank.py"), CONFIG, self.checkpoint,
                     python_checkpoint, os.path.join(self.first, "config.json"), order, *KEYS])

        exported = safetensors(os.path.join(self.first, "model.safetensors"))
        loaded = dict(numpy.load(python_checkpoint + ".npz"))
        self.assertEqual(sorted(loaded), sorted(exported))
        for name, values in exported.items():
            numpy.testing.assert_array_equal(loaded[name], values, name)
        if order == "forward":  # the same layout: the same file, byte for byte
            self.assertTrue(same_export(self.first, python_checkpoint + ".export"),
                            "Python's export differs from meshrun train's")

        resumed = os.path.join(self.root, f"resumed_python_{order}")
        self.train(resumed, "train.steps=6", f"checkpoint.resume_from={python_checkpoint}")
        own, python = metrics(self.own), metrics(resumed)
        self.assertEqual([m["step"] for m in python], [5, 6])
        for key in ("loss", "grad_norm", "lr"):
            self.assertEqual([m[key] for m in python], [m[key] for m in own], key)
        self.assertTrue(same_export(self.own, resumed), "the resumed runs' exports differ")

    def test_into_meshrun_s_own_layout_and_back(self):
        self.round_trip("forward")

    def test_into_hugging_face_s_parameter_order_and_back(self):
        self.round_trip("hf")


if __name__ == "__main__":
    MESHRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
