"""`meshrun train` of a mixture of experts (model_type "mixtral") with expert
parallelism (distributed.ep_size > 1): experts spread over the ep ranks,
tokens dispatched to them and combined back by all-to-alls, the experts'
FSDP2 over ep_shard.

Run by ctest: test_moe.py MESHRUN_EXE [TestClass ...]

Independent reference: a PyTorch Mixtral in float64 (transformers'
modeling_mixtral.py written out) on the exported weights gives the
validation loss, and on the starting weights and the step's training batch
the gradient norm of the objective (cross-entropy + router_aux_loss_coef x
the load-balancing loss) and the load-balancing loss itself. Measured: within 3e-8 relative (all
three); held to 1e-5, float32 against float64 over a few hundred terms.

Expert parallelism: ep = 2 and 4 on 4 ranks (alone, with activation
checkpointing, HSDP, and pp = 2 under 1F1B and interleaved zero bubble)
against 1 rank on the same global batch, every step: losses, validation losses and gradient norms
within test_train.py's 1e-4 relative, exported weights within 2e-5
absolute (measured: 1.2e-7 for ep = 1 on 4 ranks, 3.9e-7 for ep = 2, 8.3e-7
for ep = 4, 6.4e-7 for ep = 2 with pp = 2: the experts see their rows in
another order, so the weight gradients' sums differ in the last bits). Routing ties go to the lower
expert on every rank alike.
"""

import json
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from meshrun_testing import InputErrorAssertions  # noqa: E402
from test_autocast import grad_norms, largest_weight_difference, val_losses  # noqa: E402
from test_gpt2 import (RELOAD, TORCH_MISSING, load_safetensors,  # noqa: E402
                       validation_windows)
from test_train import TINY, Runs, TrainTest, losses, metrics, run  # noqa: E402

if not TORCH_MISSING:
    import torch

# test_train.py's tiny run, with a tiny Mixtral: 4 experts, 2 per token.
TINY_MOE = """
[model]
model_type = "mixtral"
vocab_size = 256
hidden_size = 32
intermediate_size = 48
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
num_local_experts = 4
num_experts_per_tok = 2
router_aux_loss_coef = 0.02

""" + TINY[TINY.index("[data]"):TINY.index("[distributed]")] + """
[distributed]
strategy = "fsdp2"
mp_policy.param_dtype = "float32"
"""
GRAD_NORM_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 2e-5
TORCH_TOLERANCE = 1e-5


class MoeRuns(Runs):
    def __init__(self):
        super().__init__()
        with open(self.config, "w") as f:
            f.write(TINY_MOE)


def ep(size):
    return (f"distributed.ep_size={size}",)


PP2 = ("distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=2",
       "distributed.pipeline.pp_batch_size=4")


class MoeTest(TrainTest):
    @classmethod
    def setUpClass(cls):
        cls.runs = MoeRuns()
        cls.reference = cls.runs.train("one-rank", 1)

    def assert_trains_as_one_rank(self, output, reference=None):
        reference = reference or self.reference
        self.assert_close(losses(reference), losses(output))
        self.assert_close(val_losses(reference), val_losses(output))
        for step, (a, b) in enumerate(zip(grad_norms(reference), grad_norms(output)), 1):
            self.assertLessEqual(abs(a - b), GRAD_NORM_TOLERANCE * a, f"step {step}")
        self.assertLessEqual(largest_weight_difference(reference, output), WEIGHT_TOLERANCE)


class Equivalence(MoeTest):
    def test_ep2_and_ep4_train_as_one_rank(self):
        for size in (2, 4):
            with self.subTest(ep=size):
                output = self.runs.train(f"ep{size}", 4, *ep(size))
                self.assert_trains_as_one_rank(output)
                expected = [m["expert_tokens"] for m in metrics(self.reference)]
                self.assertEqual(expected, [m["expert_tokens"] for m in metrics(output)])
                self.assertTrue(all(m["ep_bytes"] > 0 for m in metrics(output)))

    def test_ep2_with_activation_checkpointing(self):
        for mode in ("full", "selective"):
            with self.subTest(mode=mode):
                output = self.runs.train(f"ep2-ac-{mode}", 4, *ep(2),
                                         f"distributed.activation_checkpointing={mode}")
                self.assert_trains_as_one_rank(output)

    def test_ep2_with_pp2(self):
        schedules = (("1f1b", ()), ("interleaved_zero_bubble",
                                    ("distributed.pipeline.layers_per_stage=1",)))
        for schedule, keys in schedules:
            with self.subTest(schedule=schedule):
                output = self.runs.train(f"ep2-pp2-{schedule}", 4, *ep(2), *PP2,
                                         f"distributed.pipeline.pp_schedule={schedule}", *keys)
                self.assert_trains_as_one_rank(output)
                expected = [m["expert_tokens"] for m in metrics(self.reference)]
                self.assertEqual(expected, [m["expert_tokens"] for m in metrics(output)])

    def test_ep2_with_hsdp_and_reshard_after_forward(self):
        output = self.runs.train("ep2-hsdp", 4, *ep(2), "distributed.dp_replicate_size=2",
                                 "distributed.moe.reshard_after_forward=true")
        self.assert_trains_as_one_rank(output)

    def test_metrics_report_the_routers(self):
        tokens = 8 * 32 * 2 * 2  # global batch x seq_len x top-k x layers
        for m in metrics(self.reference):
            self.assertEqual(sum(m["expert_tokens"]), tokens)
            self.assertEqual(len(m["expert_tokens"]), 4)
            self.assertGreaterEqual(m["aux_loss"], 1.0)  # its least: balanced routing, E sum f P


class Checkpoints(MoeTest):
    def test_a_checkpoint_resumes_over_other_ep_sizes(self):
        saved = self.runs.train("save-ep4", 4, *ep(4), "checkpoint.save_every=2")
        step2 = os.path.join(saved, "checkpoints", "step_2")
        for nproc, size, more in ((4, 2, ()), (2, 1, ()), (4, 2, PP2)):
            with self.subTest(ep=size, pp=2 if more else 1):
                resumed = self.runs.train(f"resume-ep{size}-{len(more)}", nproc, *ep(size), *more,
                                          f"checkpoint.resume_from={step2}")
                self.assert_close(losses(self.reference)[2:], losses(resumed))
                self.assertLessEqual(largest_weight_difference(self.reference, resumed),
                                     WEIGHT_TOLERANCE)


class Export(MoeTest):
    def test_export_has_hugging_face_names_and_config(self):
        header = load_safetensors(os.path.join(self.reference, "model.safetensors"))
        self.assertEqual(tuple(header["model.layers.1.block_sparse_moe.gate.weight"].shape), (4, 32))
        self.assertEqual(tuple(header["model.layers.0.block_sparse_moe.experts.3.w2.weight"].shape),
                         (32, 48))
        with open(os.path.join(self.reference, "config.json")) as f:
            config = json.load(f)
        self.assertEqual(config["architectures"], ["MixtralForCausalLM"])
        self.assertEqual((config["num_local_experts"], config["num_experts_per_tok"]), (4, 2))

    def test_export_of_ep4_reloads_with_the_same_loss(self):
        # On 1 rank: the validation sum runs over 1 rank instead of 4, which
        # moves the last bits (measured 1.1e-7 relative).
        exported = self.runs.train("export-ep4", 4, *ep(4))
        reloaded = self.runs.train("reload", 1, f"model.checkpoint={exported}", *RELOAD)
        expected, actual = val_losses(exported)[-1], val_losses(reloaded)[-1]
        self.assertLessEqual(abs(expected - actual), 1e-6 * expected)


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, theta):
    """transformers' apply_rotary_pos_emb: channels i and i + d/2 turn together."""
    T, d = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


def mixtral_objective(w, c, inputs, targets):
    """MixtralForCausalLM's mean cross-entropy on inputs [B, T] and the
    load-balancing loss (load_balancing_loss_func) of each layer, averaged
    over the layers, in float64."""
    B, T = inputs.shape
    H, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    E, K, d = c["num_local_experts"], c["num_experts_per_tok"], H // heads
    eps = c["rms_norm_eps"]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    x = w["model.embed_tokens.weight"][inputs]
    aux = 0
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        y = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (y @ w[p + "self_attn.q_proj.weight"].T).view(B, T, heads, d).transpose(1, 2)
        k = (y @ w[p + "self_attn.k_proj.weight"].T).view(B, T, kv, d).transpose(1, 2)
        v = (y @ w[p + "self_attn.v_proj.weight"].T).view(B, T, kv, d).transpose(1, 2)
        q, k = rotate(q, c["rope_theta"]), rotate(k, c["rope_theta"])
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = (q @ k.transpose(-1, -2)) / d ** 0.5
        attention = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
        x = x + attention.transpose(1, 2).reshape(B, T, H) @ w[p + "self_attn.o_proj.weight"].T
        y = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps).reshape(B * T, H)
        probs = torch.softmax(y @ w[p + "block_sparse_moe.gate.weight"].T, -1)
        weights, chosen = torch.topk(probs, K, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(y)
        for e in range(E):
            e_ = p + f"block_sparse_moe.experts.{e}."
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            h = y[rows]
            h = (torch.nn.functional.silu(h @ w[e_ + "w1.weight"].T) * (h @ w[e_ + "w3.weight"].T))
            out = out.index_add(0, rows, weights[rows, slot, None] * (h @ w[e_ + "w2.weight"].T))
        x = x + out.view(B, T, H)
        mask = torch.nn.functional.one_hot(chosen, E).to(torch.float64)
        aux = aux + E * (mask.mean(0) * probs.mean(0)).sum()
    x = rms_norm(x, w["model.norm.weight"], eps)
    logits = x @ w["lm_head.weight"].T
    loss = torch.nn.functional.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1))
    return loss, aux / c["num_hidden_layers"]


def mix(x):
    """trainer/train/data.cpp's splitmix64 finalizer."""
    mask = (1 << 64) - 1
    x = (x + 0x9e3779b97f4a7c15) & mask
    x = ((x ^ (x >> 30)) * 0xbf58476d1ce4e5b9) & mask
    x = ((x ^ (x >> 27)) * 0x94d049bb133111eb) & mask
    return x ^ (x >> 31)


def training_batch(config, step, rows):
    """trainer/train/data.cpp's training windows of `step` (0-based): (inputs, targets)."""
    with open(config["data"]["path"], "rb") as f:
        data = f.read()
    seq_len = config["data"]["seq_len"]
    train_bytes = len(data) - int(len(data) * config["data"]["val_fraction"])
    seed = config["train"]["seed"]
    offsets = [mix(mix(mix(seed) ^ step) ^ row) % (train_bytes - seq_len) for row in range(rows)]
    windows = torch.tensor([list(data[o:o + seq_len + 1]) for o in offsets], dtype=torch.long)
    return windows[:, :-1], windows[:, 1:]


@unittest.skipIf(TORCH_MISSING, TORCH_MISSING or "")
class PyTorchReference(MoeTest):
    def setUp(self):
        import tomllib
        self.config = tomllib.loads(TINY_MOE)
        with open(os.path.join(self.reference, "config.json")) as f:
            self.hf_config = json.load(f)

    def test_val_loss_matches(self):
        data = self.config["data"]
        inputs, targets = validation_windows(data["path"], data["seq_len"], data["val_fraction"])
        weights = load_safetensors(os.path.join(self.reference, "model.safetensors"))
        with torch.no_grad():
            expected, _ = mixtral_objective(weights, self.hf_config, inputs, targets)
        actual = val_losses(self.reference)[-1]
        self.assertLessEqual(abs(actual - expected.item()), TORCH_TOLERANCE * expected.item())

    def test_first_step_gradient_and_aux_loss_match(self):
        # A step with lr 1e-30 exports the starting weights the step's
        # gradient was taken at; coefficient 1 makes the load-balancing
        # loss's share of the gradient large (measured: leaving its gradient
        # out moves the norm by 25% relative; meshrun is within 4.9e-8).
        start = self.runs.train("start", 2, *ep(2), *RELOAD, "model.router_aux_loss_coef=1.0")
        with open(os.path.join(start, "config.json")) as f:
            self.hf_config = json.load(f)
        weights = load_safetensors(os.path.join(start, "model.safetensors"))
        for tensor in weights.values():
            tensor.requires_grad_(True)
        inputs, targets = training_batch(self.config, 0, self.config["train"]["global_batch_size"])
        micro = self.config["train"]["micro_batch_size"]
        coef = self.hf_config["router_aux_loss_coef"]
        objective, aux_sum = 0, 0
        for first in range(0, inputs.shape[0], micro):
            loss, aux = mixtral_objective(weights, self.hf_config, inputs[first:first + micro],
                                          targets[first:first + micro])
            objective = objective + loss + coef * aux
            aux_sum += aux.item()
        batches = inputs.shape[0] // micro
        (objective / batches).backward()
        norm = torch.sqrt(sum((t.grad ** 2).sum() for t in weights.values())).item()
        step = metrics(start)[0]
        self.assertLessEqual(abs(step["grad_norm"] - norm), TORCH_TOLERANCE * norm)
        self.assertLessEqual(abs(step["aux_loss"] - aux_sum / batches),
                             TORCH_TOLERANCE * aux_sum / batches)


class BadInput(MoeTest, InputErrorAssertions):
    @classmethod
    def setUpClass(cls):
        cls.runs = MoeRuns()
        cls.dense = Runs()

    @classmethod
    def tearDownClass(cls):
        cls.runs.cleanup()
        cls.dense.cleanup()

    def test_a_dense_model_has_no_experts(self):
        result = run(self.dense.config, "--nproc-per-node", "2", "--output",
                     os.path.join(self.dense.root, "refused"), "distributed.strategy=fsdp2",
                     *ep(2))
        self.assert_input_error(result, "distributed.ep_size", "has no experts")

    def test_refused(self):
        cases = [
            (("distributed.ep_size=3",), 3, "distributed.ep_size", "does not divide"),
            (("distributed.ep_size=2", "distributed.tp_size=2"), 4, "distributed.tp_size",
             "expert parallelism"),
            (("distributed.ep_size=2", "distributed.moe.ignore_router_for_ac=true"), 2,
             "distributed.moe.ignore_router_for_ac", "not implemented"),
            (("model.num_experts_per_tok=5",), 1, "model.num_experts_per_tok", "cannot be more"),
            (("distributed.tp_size=2",), 2, "distributed.tp_size",
             "computes no tensor parallelism"),
            (("distributed.cp_size=2",), 2, "distributed.cp_size",
             "computes no context parallelism"),
        ]
        for overrides, nproc, key, needle in cases:
            with self.subTest(key=key):
                result = run(self.runs.config, "--nproc-per-node", str(nproc),
                             "--output", os.path.join(self.runs.root, "refused"), *overrides)
                self.assert_input_error(result, key, needle)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[2:])
