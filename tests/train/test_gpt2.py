"""`meshrun train` with the GPT-2 model plugin (model_type "gpt2"), on a tiny
GPT-2 so that each run takes a few seconds, against 1 rank and against an
independent PyTorch GPT-2 written from Hugging Face's definitions.

Run by ctest: test_gpt2.py MESHRUN_EXE [TestClass ...]

Tolerances:
- ddp and fsdp2 (float32) on 2 ranks, and pp = 2 pipelines (fsdp2, float32)
  against 1 rank: the same sequences in float32; only the summation order of
  the gradients (and of the validation losses) differs, ~1e-7 relative,
  carried through a few AdamW steps: losses agree to 1e-4 relative, as in
  test_train.py and test_pipeline.py.
- The export reloaded on the same world size, after a step whose learning
  rate is too small to move a float32 weight, repeats the same validation:
  the same val_loss, exactly.
- The PyTorch reference computes in float64 from the exported float32
  weights; meshrun computes in float32 and sums the validation losses in
  float32: ~1e-7 relative per token, partly averaging out, so 1e-5
  relative. A wrong convention (Conv1D layout, head split, scale, LayerNorm
  variance, GELU variant, positions, tied head) moves the loss by far more.
  Seen: below 1e-7 relative.
"""

import json
import math
import os
import sys
import tomllib
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from meshrun_testing import InputErrorAssertions  # noqa: E402
from test_train import (TINY, Runs, TrainTest, losses, metrics, read_safetensors,  # noqa: E402
                        run, safetensors_header)

try:  # the PyTorch reference alone needs them
    import numpy
    import torch
    TORCH_MISSING = None
except ImportError as error:
    TORCH_MISSING = f"the PyTorch reference needs torch and numpy, which cannot be imported ({error})"

# test_train.py's tiny run, with a tiny GPT-2 for its model.
TINY_GPT2 = """
[model]
model_type = "gpt2"
vocab_size = 256
n_positions = 48
n_embd = 32
n_layer = 4
n_head = 4

""" + TINY[TINY.index("[data]"):]
DATA = tomllib.loads(TINY_GPT2)["data"]

FP32 = ("distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=float32")
UNTIED = ("model.tie_word_embeddings=false",)
PP2 = FP32 + UNTIED + ("distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=2",
                       "distributed.pipeline.pp_batch_size=8")
RELOAD = ("train.steps=1", "train.lr=1e-30", "train.min_lr=0", "train.weight_decay=0")


class Gpt2Runs(Runs):
    """Runs of the tiny GPT-2 config."""

    def __init__(self):
        super().__init__()
        with open(self.config, "w") as f:
            f.write(TINY_GPT2)


def val_losses(output):
    return [m["val_loss"] for m in metrics(output) if "val_loss" in m]


def hugging_face_names(layers, tied):
    """GPT2LMHeadModel's state dict as exported: {name: shape}."""
    names = {"transformer.wte.weight": [256, 32], "transformer.wpe.weight": [48, 32],
             "transformer.ln_f.weight": [32], "transformer.ln_f.bias": [32]}
    for n in range(layers):
        p = f"transformer.h.{n}."
        names.update({p + "ln_1.weight": [32], p + "ln_1.bias": [32],
                      p + "attn.c_attn.weight": [32, 96], p + "attn.c_attn.bias": [96],
                      p + "attn.c_proj.weight": [32, 32], p + "attn.c_proj.bias": [32],
                      p + "ln_2.weight": [32], p + "ln_2.bias": [32],
                      p + "mlp.c_fc.weight": [32, 128], p + "mlp.c_fc.bias": [128],
                      p + "mlp.c_proj.weight": [128, 32], p + "mlp.c_proj.bias": [32]})
    if not tied:
        names["lm_head.weight"] = [256, 32]
    return names


def load_safetensors(path):
    """{name: float64 torch tensor} of a float32 safetensors file."""
    tensors = {}
    for name, (_, shape, raw) in read_safetensors(path).items():
        array = numpy.frombuffer(raw, dtype="<f4").reshape(shape)
        tensors[name] = torch.from_numpy(array.astype(numpy.float64))
    return tensors


def validation_windows(path, seq_len, val_fraction):
    """The held-out tail cut into consecutive windows of seq_len + 1 bytes:
    (inputs, targets), each [windows, seq_len]."""
    with open(path, "rb") as f:
        data = f.read()
    val_bytes = int(len(data) * val_fraction)
    start = len(data) - val_bytes
    count = val_bytes // (seq_len + 1)
    windows = torch.tensor([list(data[start + i * (seq_len + 1):start + (i + 1) * (seq_len + 1)])
                            for i in range(count)], dtype=torch.long)
    return windows[:, :-1], windows[:, 1:]


def gpt2_loss(w, config, inputs, targets):
    """Mean cross-entropy of GPT2LMHeadModel (transformers' modeling_gpt2.py)
    on inputs [B, T], in float64."""
    E, H, eps = config["n_embd"], config["n_head"], config["layer_norm_epsilon"]
    B, T = inputs.shape
    d = E // H

    def layer_norm(x, prefix):
        return torch.nn.functional.layer_norm(x, (E,), w[prefix + ".weight"], w[prefix + ".bias"],
                                              eps)

    def conv1d(x, prefix):  # Conv1D: x W + b, W [in, out]
        return x @ w[prefix + ".weight"] + w[prefix + ".bias"]

    def heads(x):
        return x.view(B, T, H, d).transpose(1, 2)

    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    x = w["transformer.wte.weight"][inputs] + w["transformer.wpe.weight"][torch.arange(T)]
    for n in range(config["n_layer"]):
        p = f"transformer.h.{n}."
        q, k, v = conv1d(layer_norm(x, p + "ln_1"), p + "attn.c_attn").split(E, dim=-1)
        scores = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(d)
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        attended = (probs @ heads(v)).transpose(1, 2).reshape(B, T, E)
        x = x + conv1d(attended, p + "attn.c_proj")
        h = conv1d(layer_norm(x, p + "ln_2"), p + "mlp.c_fc")
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
        x = x + conv1d(h, p + "mlp.c_proj")
    head = w["transformer.wte.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    logits = layer_norm(x, "transformer.ln_f") @ head.T
    return torch.nn.functional.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1)).item()


class Gpt2Test(TrainTest):
    @classmethod
    def setUpClass(cls):
        cls.runs = Gpt2Runs()
        cls.tied = cls.runs.train("tied1", 1)
        cls.untied = cls.runs.train("untied1", 1, *UNTIED)

    def assert_same_run(self, expected, actual):
        self.assert_close(losses(expected), losses(actual))
        self.assert_close(val_losses(expected), val_losses(actual))


class Equivalence(Gpt2Test):
    def test_ddp_on_two_ranks_matches_one_rank(self):
        self.assert_same_run(self.tied, self.runs.train("ddp2", 2))
        self.assertEqual(len(val_losses(self.tied)), 2)

    def test_fsdp2_on_two_ranks_matches_one_rank(self):
        self.assert_same_run(self.tied, self.runs.train("fsdp2", 2, *FP32))

    def test_pipelines_match_one_rank(self):
        for schedule in ("1f1b", "zbv_zero_bubble"):
            with self.subTest(schedule=schedule):
                output = self.runs.train(f"pp_{schedule}", 2, *PP2,
                                         f"distributed.pipeline.pp_schedule={schedule}")
                self.assert_same_run(self.untied, output)
                self.assert_close([m["grad_norm"] for m in metrics(self.untied)],
                                  [m["grad_norm"] for m in metrics(output)])


class Export(Gpt2Test):
    def test_export_has_hugging_face_names_and_shapes(self):
        for output, tied in ((self.tied, True), (self.untied, False)):
            with self.subTest(tied=tied):
                header = safetensors_header(os.path.join(output, "model.safetensors"))
                self.assertEqual(header.pop("__metadata__"), {"format": "pt"})
                self.assertEqual({name: t["shape"] for name, t in header.items()},
                                 hugging_face_names(4, tied))
                self.assertEqual({t["dtype"] for t in header.values()}, {"F32"})
                with open(os.path.join(output, "config.json")) as f:
                    config = json.load(f)
                self.assertEqual(config["architectures"], ["GPT2LMHeadModel"])
                self.assertEqual(config["model_type"], "gpt2")
                self.assertEqual((config["n_embd"], config["n_layer"], config["n_head"],
                                  config["n_positions"], config["n_ctx"], config["n_inner"]),
                                 (32, 4, 4, 48, 48, 128))
                self.assertEqual(config["activation_function"], "gelu_new")
                self.assertEqual(config["tie_word_embeddings"], tied)

    def test_export_reloads(self):
        reloaded = self.runs.train("reload", 1, f"model.checkpoint={self.tied}", *RELOAD)
        self.assertEqual(val_losses(self.tied)[-1], val_losses(reloaded)[-1])

    @unittest.skipIf(TORCH_MISSING, TORCH_MISSING or "")
    def test_val_loss_matches_a_pytorch_gpt2(self):
        inputs, targets = validation_windows(DATA["path"], DATA["seq_len"], DATA["val_fraction"])
        for output in (self.tied, self.untied):
            with self.subTest(output=os.path.basename(output)):
                with open(os.path.join(output, "config.json")) as f:
                    config = json.load(f)
                weights = load_safetensors(os.path.join(output, "model.safetensors"))
                expected = gpt2_loss(weights, config, inputs, targets)
                actual = val_losses(output)[-1]
                self.assertLessEqual(abs(actual - expected), 1e-5 * expected,
                                     f"meshrun {actual} vs PyTorch {expected}")


class BadInput(Gpt2Test, InputErrorAssertions):
    @classmethod
    def setUpClass(cls):
        cls.runs = Gpt2Runs()

    def assert_refused(self, *overrides, needles=()):
        result = run(self.runs.config, "--nproc-per-node", "2", "--output",
                     os.path.join(self.runs.root, "bad"), *overrides)
        self.assert_input_error(result, *needles)
        self.assertFalse(os.path.exists(os.path.join(self.runs.root, "bad")))

    def test_tied_embeddings_cannot_be_split_over_pipeline_stages(self):
        self.assert_refused(*FP32, "distributed.pp_size=2",
                            "distributed.pipeline.pp_microbatch_size=2",
                            "distributed.pipeline.pp_batch_size=8",
                            needles=("distributed.pp_size", "transformer.wte.weight"))

    def test_sequences_longer_than_n_positions(self):
        self.assert_refused("data.seq_len=49", needles=("data.seq_len", "48 positions"))

    def test_other_activations_and_dropout(self):
        self.assert_refused("model.activation_function=gelu",
                            needles=("model.activation_function", "gelu_new"))
        self.assert_refused("model.resid_pdrop=0.1", needles=("model.resid_pdrop", "dropout"))


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)
