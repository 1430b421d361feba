"""`meshrun train` with activation checkpointing against the same run without.

Run by ctest: test_activation_checkpointing.py MESHRUN_EXE [TestClass ...]

Tolerance: none. A checkpointed layer's backward runs its forward again with
the same input, parameters and ops, then the same backward, so the losses
and the exported weights are bit-identical, under ddp, fsdp2 (bfloat16
casts at every layer included) and pipelines with a full and a split
(zero-bubble) backward; "full" recomputes a layer's whole forward,
"selective" its element-wise part (norms, activation functions) from the
matmul outputs it keeps. What is held for backward must shrink, more with
"full".
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train import Runs, TrainTest, losses, metrics, read_bytes  # noqa: E402
from test_gpt2 import Gpt2Runs  # noqa: E402

SHORT = ("train.steps=2", "train.val_every=0")
PP2 = ("distributed.strategy=fsdp2", "distributed.pp_size=2",
       "distributed.pipeline.pp_microbatch_size=2", "distributed.pipeline.pp_batch_size=8")
SETUPS = {  # name: overrides, on 2 ranks
    "ddp": ("distributed.strategy=ddp",),
    "fsdp2": ("distributed.strategy=fsdp2",),
    "1f1b": PP2 + ("distributed.pipeline.pp_schedule=1f1b",),
    "zbv": PP2 + ("distributed.pipeline.pp_schedule=zbv_zero_bubble",),
}
# Selective where it differs most: bfloat16 casts, and a split backward.
MODES = {"ddp": ("full",), "fsdp2": ("full", "selective"), "1f1b": ("full",),
         "zbv": ("full", "selective")}


class Checkpointing:
    """Every setup with and without checkpointing; `runs` and `model` come
    from the subclass."""

    model = ()

    def train(self, name, *overrides):
        return self.runs.train(name, 2, *self.model, *SHORT, *overrides)

    def test_recompute_is_bit_identical_and_holds_less(self):
        for name, overrides in SETUPS.items():
            kept = self.train(name, *overrides)
            held = {}
            for mode in MODES[name]:
                with self.subTest(setup=name, mode=mode):
                    recomputed = self.train(f"{name}-{mode}", *overrides,
                                            f"distributed.activation_checkpointing={mode}")
                    self.assertEqual(losses(kept), losses(recomputed))
                    self.assertEqual(read_bytes(os.path.join(kept, "model.safetensors")),
                                     read_bytes(os.path.join(recomputed, "model.safetensors")))
                    held[mode] = [m["mem"]["activations"] for m in metrics(recomputed)]
                    for before, after in zip(metrics(kept), held[mode]):
                        self.assertLess(after, before["mem"]["activations"])
                    self.assertEqual(metrics(recomputed)[-1]["mem"]["activations_peak"],
                                     max(held[mode]))
            if len(held) == 2:
                self.assertLess(max(held["full"]), min(held["selective"]))


class Llama(Checkpointing, TrainTest):
    model = ("model.num_hidden_layers=4",)


class Gpt2(Checkpointing, TrainTest):
    model = ("model.tie_word_embeddings=false",)

    @classmethod
    def setUpClass(cls):
        cls.runs = Gpt2Runs()


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)
