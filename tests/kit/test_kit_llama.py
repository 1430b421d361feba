"""The model kit against its oracle: the shipped `llama` (models/llama/plugin.cpp,
composed from meshrun/kit.h) and `hand_llama` (tests/kit, the hand-written
Llama family it replaced, llama/decoder.hpp) trained on the same
config: on 1 rank, fsdp2 with bfloat16 matmuls, tp 2 (with and without
sequence parallelism), cp 2 and a 2-stage zero-bubble pipeline with
selective checkpointing; and what `meshrun plan --estimate` says of each.

Run by ctest: test_kit_llama.py MESHRUN_EXE [TestClass ...]
(MESHRUN_PLUGIN_PATH names the folder holding hand_llama).

Tolerance: none. Both compute the same kernels on the same shapes in the
same order (the kit sums a tensor's gradients as the hand-written decoder
does: the residual stream's in place, each norm adding into it), from the
same initialization, so every loss, gradient norm and exported weight is
equal bit for bit. The exported config.json agrees on every key but
model_type.
"""

import json
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
sys.path.insert(0, os.path.join(HERE, ".."))
from test_train import MESHRUN, Runs, metrics, read_safetensors  # noqa: E402

FP32 = ("distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=float32")
HAND = ("model.model_type=hand_llama",)
CASES = {
    "one_rank": (1, ()),
    "fsdp2_bfloat16": (2, ("distributed.strategy=fsdp2",)),
    "tp2": (2, FP32 + ("distributed.tp_size=2",)),
    "tp2_sequence_parallel": (2, FP32 + ("distributed.tp_size=2",
                                         "distributed.sequence_parallel=true")),
    "cp2": (2, FP32 + ("distributed.cp_size=2",)),
    "pp2_checkpointed": (2, FP32 + ("model.num_hidden_layers=4", "distributed.pp_size=2",
                                    "distributed.pipeline.pp_microbatch_size=2",
                                    "distributed.pipeline.pp_batch_size=8",
                                    "distributed.pipeline.pp_schedule=zbv_zero_bubble",
                                    "distributed.activation_checkpointing=selective")),
}


class ComposedLlama(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.runs = Runs()

    @classmethod
    def tearDownClass(cls):
        cls.runs.cleanup()

    def assert_same_training(self, name, nproc, overrides):
        llama = self.runs.train(f"hand_{name}", nproc, *overrides, *HAND)
        kit = self.runs.train(f"kit_{name}", nproc, *overrides)
        for key in ("loss", "grad_norm", "val_loss"):
            expected = [m[key] for m in metrics(llama) if key in m]
            self.assertGreater(len(expected), 0, key)
            self.assertEqual([m[key] for m in metrics(kit) if key in m], expected, key)
        self.assertEqual(read_safetensors(os.path.join(kit, "model.safetensors")),
                         read_safetensors(os.path.join(llama, "model.safetensors")))
        with open(os.path.join(llama, "config.json")) as f:
            llama_config = json.load(f)
        with open(os.path.join(kit, "config.json")) as f:
            kit_config = json.load(f)
        self.assertEqual(kit_config.pop("model_type"), "llama")
        self.assertEqual(llama_config.pop("model_type"), "hand_llama")
        for key in ("torch_dtype", "transformers_version"):
            llama_config.pop(key, None)
            kit_config.pop(key, None)
        self.assertEqual(kit_config, llama_config)

    def plan(self, nproc, overrides):
        result = subprocess.run([MESHRUN, "plan", self.runs.config, "--world-size", str(nproc),
                                 "--estimate", "--hardware", "h100-sxm", "--json", *overrides],
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        plan = json.loads(result.stdout)
        return plan["estimate"], plan["memory"]

    def test_the_estimate_is_the_hand_written_llamas(self):
        for name, (nproc, overrides) in CASES.items():
            with self.subTest(name=name):
                self.assertEqual(self.plan(nproc, overrides), self.plan(nproc, overrides + HAND))

    def test_every_parallelism_trains_bit_for_bit_as_the_hand_written_one(self):
        for name, (nproc, overrides) in CASES.items():
            with self.subTest(name=name):
                self.assert_same_training(name, nproc, overrides)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)
