"""The peer for the `meshrun train` benchmark: PyTorch 1.13 eager Llama under DDP over gloo.

A self-contained re-implementation of Hugging Face's LlamaForCausalLM (the
transformers package is not available here), trained the way `meshrun train`
trains, so that the two can be compared on the same machine with the same
config: the TOML file meshrun reads ([model], [data], [train]), byte-level
tokens, micro-batches with gradient accumulation up to train.global_batch_size
across ranks (DDP's no_sync on all but the last micro-batch), AdamW with
linear warmup and cosine decay to min_lr, and global-norm gradient clipping.
One thread per rank, so both sides run on one core per rank through the BLAS
torch is linked to (Debian's libblas.so.3, which is OpenBLAS when the
alternative points there; the summary names the library actually loaded).

Runs with Debian's /usr/bin/python3 and python3-torch. Rank 0 prints one JSON
line per step and a final summary line; ranks meet over TCP on 127.0.0.1 only.

    /usr/bin/python3 tests/bench/torch_llama_ddp.py examples/llama-tiny.toml --nproc 2
    /usr/bin/python3 tests/bench/torch_llama_ddp.py examples/llama-tiny.toml --no-ddp \
        --global-batch-size 8      # the 1-rank baseline without communication
"""

import os

# One compute thread per rank. Set before torch loads so that OpenMP and the
# pthread build of OpenBLAS both see it (torch.set_num_threads alone does not
# reach OpenBLAS's own thread pool).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"

import argparse
import json
import math
import socket
import statistics
import time
import tomllib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

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


def load_config(path):
    """Reads meshrun's TOML file: the [model], [data] and [train] tables, with meshrun's defaults."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
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


def loaded_blas():
    """The BLAS shared objects mapped into this process, resolved (e.g. openblas-pthread)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "blas" in line.lower() and "/" in line}
    return sorted({os.path.realpath(p) for p in paths})


def previous_step_overlap(ddp_model):
    """(all-reduce span, part of it hidden behind backward compute) in s, or None.

    DDP's host-side runtime stats for its last synced backward: the span runs from the
    first bucket's launch to the reducer's finalize; the part before backward compute ends
    is hidden. DDP files them at the next synced forward, so after step k's last forward
    they describe step k - 1 (none yet at the first step).
    """
    data = ddp_model._get_ddp_logging_data()
    if "backward_comm_time" not in data:
        return None
    return data["backward_comm_time"] / 1e9, data["backward_compute_comm_overlap_time"] / 1e9


def worker(rank, nproc, port, args):
    """One rank: builds the model, trains args.steps steps, and reports from rank 0."""
    torch.set_num_threads(1)
    model_cfg, data_cfg, train = load_config(args.config)
    if args.steps is not None:
        train["steps"] = args.steps
    if args.global_batch_size is not None:
        train["global_batch_size"] = args.global_batch_size
    seq_len, micro = data_cfg["seq_len"], train["micro_batch_size"]
    per_rank, rest = divmod(train["global_batch_size"], nproc)
    if rest or per_rank % micro:
        raise SystemExit(f"train.global_batch_size {train['global_batch_size']} is not divisible "
                         f"by micro_batch_size {micro} x {nproc} ranks")
    accumulation = per_rank // micro
    tokens = training_bytes(data_cfg)

    torch.manual_seed(train["seed"])
    model = LlamaForCausalLM(model_cfg)
    if args.no_ddp:
        wrapped = model
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=nproc)
        wrapped = DistributedDataParallel(model)
        wrapped._set_ddp_runtime_logging_sample_rate(1)
    betas = tuple(train["betas"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=train["lr"], betas=betas,
                                  eps=train["eps"], weight_decay=train["weight_decay"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, train))

    records, overlaps = [], []
    for step in range(train["steps"]):
        start = time.perf_counter()
        inputs, targets = global_batch(tokens, seq_len, train["global_batch_size"],
                                       train["seed"], step)
        inputs = inputs[rank * per_rank:(rank + 1) * per_rank]
        targets = targets[rank * per_rank:(rank + 1) * per_rank]
        step_loss = 0.0
        for m in range(accumulation):
            rows = slice(m * micro, (m + 1) * micro)
            last = m == accumulation - 1
            if last or args.no_ddp:
                loss = wrapped(inputs[rows], targets[rows]) / accumulation
                loss.backward()
            else:
                with wrapped.no_sync():
                    loss = wrapped(inputs[rows], targets[rows]) / accumulation
                    loss.backward()
            step_loss += loss.item()
        if train["max_grad_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        step_time = time.perf_counter() - start

        record = {"step": step + 1, "loss": step_loss, "lr": optimizer.param_groups[0]["lr"],
                  "tokens_per_s": train["global_batch_size"] * seq_len / step_time,
                  "step_time_s": step_time}
        if not args.no_ddp:
            # Outside the timed region: the loss averaged over ranks, and DDP's overlap stats.
            loss_sum = torch.tensor([step_loss])
            dist.all_reduce(loss_sum)
            record["loss"] = loss_sum.item() / nproc
            if step > args.warmup:
                overlaps.append(previous_step_overlap(wrapped))
        if rank == 0:
            print(json.dumps(record), flush=True)
            records.append(record)

    if rank == 0:
        measured = records[args.warmup:] or records
        summary = {
            "peer": "torch-ddp-gloo", "ddp": not args.no_ddp, "nproc": nproc,
            "torch": torch.__version__, "blas": loaded_blas(), "threads_per_rank": 1,
            "global_batch_size": train["global_batch_size"], "micro_batch_size": micro,
            "seq_len": seq_len, "steps": train["steps"], "warmup_steps_skipped": args.warmup,
            "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
            "tokens_per_s_mean": statistics.mean(r["tokens_per_s"] for r in measured),
            "step_time_s_mean": statistics.mean(r["step_time_s"] for r in measured),
        }
        if overlaps:
            span = sum(o[0] for o in overlaps)
            summary["allreduce_span_s_mean"] = span / len(overlaps)
            summary["allreduce_hidden_fraction"] = sum(o[1] for o in overlaps) / span
        print(json.dumps(summary), flush=True)
    if not args.no_ddp:
        dist.destroy_process_group()


def free_port():
    """A TCP port on 127.0.0.1 that is free now, for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="meshrun TOML config ([model], [data], [train])")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes), default 2")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--global-batch-size", type=int, help="override train.global_batch_size")
    parser.add_argument("--no-ddp", action="store_true",
                        help="one rank, plain model, no process group: the overhead baseline")
    parser.add_argument("--warmup", type=int, default=2,
                        help="steps left out of the summary's means (default 2)")
    args = parser.parse_args()
    if args.no_ddp:
        args.nproc = 1
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(worker, args=(args.nproc, free_port(), args), nprocs=args.nproc,
                       start_method="spawn")


if __name__ == "__main__":
    main()
