"""Hugging Face's LlamaForCausalLM in plain PyTorch, with the byte data and the
learning-rate schedule `meshrun train` uses: what examples/python/train_torch.py
trains under meshrun's strategies and tests/bench/torch_llama_ddp.py under
PyTorch's DDP.

A self-contained re-implementation (the transformers package is not
available here) with Hugging Face's module and parameter names, configured
from meshrun's TOML file ([model], [data], [train] with meshrun's defaults).
"""

import math
import tomllib

import torch
import torch.nn.functional as F
from torch import nn

# Defaults of meshrun's config schema (core/config/config.hpp) for keys a file omits.
MODEL_DEFAULTS = {
    "vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": None, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
DATA_DEFAULTS = {"path": "/usr/share/common-licenses/GPL-3", "val_fraction": 0.05, "seq_len": 256}
TRAIN_DEFAULTS = {
    "steps": 100, "global_batch_size": 16, "micro_batch_size": 4, "lr": 3e-3, "min_lr": 3e-4,
    "warmup_steps": 10, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
    "max_grad_norm": 1.0, "seed": 1234,
}


def apply_override(raw, assignment):
    """Applies one "table.key=value" override (meshrun's command-line form;
    the value is read as TOML, else as a string) to the parsed TOML `raw`."""
    key, _, value = assignment.partition("=")
    try:
        value = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    *tables, name = key.strip().split(".")
    for table in tables:
        raw = raw.setdefault(table, {})
    raw[name] = value


def load_config(path, overrides=()):
    """Reads meshrun's TOML file: the [model], [data] and [train] tables, with meshrun's defaults
    and `overrides` ("key.path=value") applied."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    for assignment in overrides:
        apply_override(raw, assignment)
    model = {**MODEL_DEFAULTS, **{k: v for k, v in raw.get("model", {}).items()
                                  if k in MODEL_DEFAULTS}}
    if model["num_key_value_heads"] is None:
        model["num_key_value_heads"] = model["num_attention_heads"]
    data = {**DATA_DEFAULTS, **raw.get("data", {})}
    train = {**TRAIN_DEFAULTS, **raw.get("train", {})}
    return model, data, train


# --- The model: Hugging Face LlamaForCausalLM, module and parameter names included ---


class LlamaRMSNorm(nn.Module):
    """x · rsqrt(mean(x²) + eps) · w, computed in float32."""

    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rotary_cos_sin(seq_len, head_dim, theta):
    """Hugging Face's rotary tables: inv_freq = θ^(−2i/d), emb = cat(freqs, freqs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    """(x1, x2) -> (−x2, x1) on the two halves of the last dimension (not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query causal self-attention with rotary positions; softmax in float32."""

    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg["hidden_size"] // self.num_heads
        hidden = cfg["hidden_size"]
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin, mask):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Query head h reads kv head h // (heads / kv_heads): repeat each kv head in place.
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim) + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg):
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, each with a residual connection."""

    def __init__(self, cfg):
        super().__init__()
        # Hugging Face's order: the norms last. meshrun's Llama lays its
        # parameters out in forward order; a sharded checkpoint finds each
        # parameter by name, so either order loads the other's.
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = LlamaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (Hugging Face's `model.` prefix)."""

    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = LlamaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        self.rope_theta = cfg["rope_theta"]

    def forward(self, tokens):
        seq = tokens.shape[1]
        cos, sin = rotary_cos_sin(seq, self.head_dim, self.rope_theta)
        mask = torch.full((seq, seq), float("-inf")).triu(1)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The decoder plus lm_head (tied to the embedding when the config says so); mean CE loss."""

    def __init__(self, cfg):
        super().__init__()
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        # Hugging Face's init: normal(0, initializer_range = 0.02) for linears and embeddings.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if cfg["tie_word_embeddings"]:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, inputs, targets):
        logits = self.lm_head(self.model(inputs))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- Training ---


def training_bytes(data_cfg):
    """The file's bytes as tokens, less the held-out validation tail (val_fraction of it)."""
    with open(data_cfg["path"], "rb") as f:
        raw = f.read()
    train_len = len(raw) - int(len(raw) * data_cfg["val_fraction"])
    if train_len < data_cfg["seq_len"] + 1:
        raise SystemExit(f"data.path: {train_len} training bytes, fewer than seq_len + 1")
    return torch.frombuffer(bytearray(raw[:train_len]), dtype=torch.uint8).long()


def global_batch(tokens, seq_len, batch_size, seed, step):
    """Random windows of seq_len + 1 tokens, the same for every world size (seeded by step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def lr_factor(step, train):
    """Linear warmup to lr, then cosine decay to min_lr at the last step (as a factor of lr)."""
    if step < train["warmup_steps"]:
        return (step + 1) / train["warmup_steps"]
    span = max(1, train["steps"] - train["warmup_steps"])
    progress = min(1.0, (step - train["warmup_steps"]) / span)
    min_factor = train["min_lr"] / train["lr"]
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))
