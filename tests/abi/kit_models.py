"""Two architectures composed out of tree from the installed model kit
(examples/kit_models: Qwen2 in C++, Phi in C), trained by `meshrun train`
under ddp, fsdp2, tp 2 (with and without sequence parallelism), cp 2 and a
2-stage pipeline against 1 rank, and
their Hugging Face exports loaded into PyTorch implementations written here
from transformers' modeling_qwen2.py and modeling_phi.py.

Run by out_of_tree_kit_models.sh: kit_models.py MESHRUN_EXE [TestClass ...]
with MESHRUN_PLUGIN_PATH naming the two plugins' folders.

Tolerances, as test_train.py, test_tensor_parallel.py and
test_context_parallel.py state them for the shipped models: every 2-rank
run computes in float32 on the same global batch as 1 rank and differs
only in the order of sums (~1e-7 relative) carried through a few AdamW
steps, so losses and validation losses agree to 1e-4 relative. The PyTorch
reference computes in float64 from the exported float32 weights, against
meshrun's float32 validation loss: 1e-5 relative (as test_gpt2.py); a wrong
convention (rotary half, partial rotary, bias, LayerNorm, GELU variant,
parallel residual, head bias) moves it by far more.
"""

import json
import math
import os
import shutil
import struct
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "train"))
sys.path.insert(0, os.path.join(HERE, ".."))
from test_gpt2 import load_safetensors, validation_windows  # noqa: E402
from test_train import TINY, Runs, metrics, read_safetensors  # noqa: E402

try:
    import torch
    TORCH_MISSING = None
except ImportError as error:
    TORCH_MISSING = f"the PyTorch reference needs torch ({error})"

TOLERANCE = 1e-4
SIZES = """vocab_size = 256
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
"""
DATA = {"path": "/usr/share/common-licenses/GPL-3", "seq_len": 32, "val_fraction": 0.05}
FP32 = ("distributed.strategy=fsdp2", "distributed.mp_policy.param_dtype=float32")
PARALLEL = {
    "ddp2": ("distributed.strategy=ddp",),
    "fsdp2": FP32,
    "tp2": FP32 + ("distributed.tp_size=2",),
    "tp2_sequence_parallel": FP32 + ("distributed.tp_size=2", "distributed.sequence_parallel=true"),
    "cp2": FP32 + ("distributed.cp_size=2",),
    "pp2": FP32 + ("distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=2",
                   "distributed.pipeline.pp_batch_size=8"),
}


def write_safetensors(path, tensors):
    """A float32 safetensors file of {name: tensor}."""
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        blob = tensor.to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def config_of(model_type):
    rest = TINY[TINY.index("[data]"):]
    return f'[model]\nmodel_type = "{model_type}"\n{SIZES}\n{rest}'


def column(output, key):
    return [m[key] for m in metrics(output) if key in m]


def rotary(x, positions, rotary_dim, theta):
    """Hugging Face's rotate_half rotary embedding on the first rotary_dim
    channels of each head of x [B, heads, T, d]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = positions[:, None].double() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    turned, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-turned[..., half:], turned[..., :half]), dim=-1)
    return torch.cat((turned * cos + rotated * sin, passed), dim=-1)


def attention(w, p, x, config, output_name, rotary_dim):
    """Causal grouped-query attention with biased q/k/v (both models)."""
    B, T, E = x.shape
    H, KV = config["num_attention_heads"], config["num_key_value_heads"]
    d = E // H

    def linear(name, h):
        return h @ w[p + name + ".weight"].T + w.get(p + name + ".bias", 0)

    def heads(h, n):
        return h.view(B, T, n, d).transpose(1, 2)

    positions = torch.arange(T)
    q = rotary(heads(linear("q_proj", x), H), positions, rotary_dim, config["rope_theta"])
    k = rotary(heads(linear("k_proj", x), KV), positions, rotary_dim, config["rope_theta"])
    v = heads(linear("v_proj", x), KV)
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
    attended = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, E)
    return linear(output_name, attended)


def qwen2_loss(w, config, inputs, targets):
    """Qwen2ForCausalLM's mean cross-entropy on inputs [B, T], in float64."""
    eps, E = config["rms_norm_eps"], config["hidden_size"]

    def rms_norm(x, name):
        return w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    d = E // config["num_attention_heads"]
    x = w["model.embed_tokens.weight"][inputs]
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        x = x + attention(w, p + "self_attn.", rms_norm(x, p + "input_layernorm.weight"), config,
                          "o_proj", d)
        h = rms_norm(x, p + "post_attention_layernorm.weight")
        m = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (
            h @ w[p + "mlp.up_proj.weight"].T)
        x = x + m @ w[p + "mlp.down_proj.weight"].T
    logits = rms_norm(x, "model.norm.weight") @ w["lm_head.weight"].T
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1)).item()


def phi_loss(w, config, inputs, targets):
    """PhiForCausalLM's mean cross-entropy on inputs [B, T], in float64."""
    eps, E = config["layer_norm_eps"], config["hidden_size"]

    def layer_norm(x, name):
        return torch.nn.functional.layer_norm(x, (E,), w[name + ".weight"], w[name + ".bias"], eps)

    def gelu_new(h):
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))

    rotary_dim = int(config["partial_rotary_factor"] * (E // config["num_attention_heads"]))
    x = w["model.embed_tokens.weight"][inputs]
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        h = layer_norm(x, p + "input_layernorm")
        attended = attention(w, p + "self_attn.", h, config, "dense", rotary_dim)
        fc1 = h @ w[p + "mlp.fc1.weight"].T + w[p + "mlp.fc1.bias"]
        mlp = gelu_new(fc1) @ w[p + "mlp.fc2.weight"].T + w[p + "mlp.fc2.bias"]
        x = attended + mlp + x
    logits = layer_norm(x, "model.final_layernorm") @ w["lm_head.weight"].T + w["lm_head.bias"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1)).item()


class KitModel:
    """The runs of one model: 1 rank, then each parallelism."""
    model_type = None
    architecture = None
    loss = None

    @classmethod
    def setUpClass(cls):
        cls.runs = Runs()
        with open(cls.runs.config, "w") as f:
            f.write(config_of(cls.model_type))
        cls.one = cls.runs.train("one_rank", 1)

    @classmethod
    def tearDownClass(cls):
        cls.runs.cleanup()

    def assert_close(self, expected, actual):
        self.assertEqual(len(expected), len(actual))
        for a, b in zip(expected, actual):
            self.assertLessEqual(abs(a - b), TOLERANCE * abs(a), f"{actual} vs {expected}")

    def test_loss_falls(self):
        losses = column(self.one, "loss")
        self.assertLess(losses[-1], losses[0])

    def test_every_parallelism_matches_one_rank(self):
        for name, overrides in PARALLEL.items():
            with self.subTest(parallelism=name):
                output = self.runs.train(name, 2, *overrides)
                self.assert_close(column(self.one, "loss"), column(output, "loss"))
                self.assert_close(column(self.one, "val_loss"), column(output, "val_loss"))

    def assert_pytorch_loss(self, output):
        with open(os.path.join(output, "config.json")) as f:
            config = json.load(f)
        weights = load_safetensors(os.path.join(output, "model.safetensors"))
        inputs, targets = validation_windows(DATA["path"], DATA["seq_len"], DATA["val_fraction"])
        expected = type(self).loss(weights, config, inputs, targets)
        actual = column(output, "val_loss")[-1]
        self.assertLessEqual(abs(actual - expected), 1e-5 * expected,
                             f"meshrun {actual} vs PyTorch {expected}")

    @unittest.skipIf(TORCH_MISSING, TORCH_MISSING or "")
    def test_export_loads_in_pytorch(self):
        with open(os.path.join(self.one, "config.json")) as f:
            config = json.load(f)
        self.assertEqual(config["model_type"], self.model_type)
        self.assertEqual(config["architectures"], [self.architecture])
        self.assert_pytorch_loss(self.one)

    # A few steps from normal(0, 0.02) leave attention almost uniform, which
    # a wrong rotary or a swapped norm would hardly move: so the export's
    # weights are redrawn at full scale (activations and attention scores of
    # order 1), loaded back by meshrun as a checkpoint and validated there
    # (a step at lr 1e-30 changes no float32 weight), and compared again.
    @unittest.skipIf(TORCH_MISSING, TORCH_MISSING or "")
    def test_full_scale_weights_give_pytorchs_loss(self):
        strong = os.path.join(self.runs.root, "strong_weights")
        os.makedirs(strong, exist_ok=True)
        shutil.copy(os.path.join(self.one, "config.json"), strong)
        generator = torch.Generator().manual_seed(3)
        redrawn = {}
        for name, (_, shape, _) in read_safetensors(os.path.join(self.one,
                                                                 "model.safetensors")).items():
            noise = torch.randn(shape, generator=generator, dtype=torch.float64)
            if name.endswith("norm.weight"):
                redrawn[name] = 1 + 0.3 * noise
            elif len(shape) == 1:
                redrawn[name] = 0.3 * noise
            elif name.startswith("model.embed_tokens"):
                redrawn[name] = noise
            else:
                redrawn[name] = 1.5 * noise / math.sqrt(shape[1])
        write_safetensors(os.path.join(strong, "model.safetensors"), redrawn)
        reloaded = self.runs.train("reloaded", 1, f"model.checkpoint={strong}", "train.steps=1",
                                   "train.lr=1e-30", "train.min_lr=0", "train.weight_decay=0")
        self.assertGreater(abs(column(reloaded, "val_loss")[-1] - column(self.one, "val_loss")[-1]),
                           0.1)
        self.assert_pytorch_loss(reloaded)


class Qwen2(KitModel, unittest.TestCase):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    loss = staticmethod(qwen2_loss)


class Phi(KitModel, unittest.TestCase):
    model_type = "phi"
    architecture = "PhiForCausalLM"
    loss = staticmethod(phi_loss)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)
