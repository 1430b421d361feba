"""One rank of tests/python/test_torch.py: a tiny Llama (examples/python/torch_llama.py)
trained a few steps under meshrun.torch.DistributedModule, checking after
every step what the wrapper promises, and leaving its parameters for the
driver to compare across strategies, world sizes and checkpoints.

    meshrun launch --nproc-per-node N -- /usr/bin/python3 tests/python/torch_rank.py \\
        --output DIR [--save-at K] [--load CKPT] [key=value ...]

Every rank starts from other random weights (seeded by its rank): the
strategy must make them data-parallel rank 0's. Checked on every rank:
- ddp: the module's parameters are views of the flat buffer, and after each
  step equal on every rank (bit for bit, through an all_gather);
- fsdp2: after each step the gathered full parameters are equal on every
  rank, the parameters the next forward materializes in each unit equal
  them (forward pre-hooks on every module with parameters, registered after
  the wrapper's), and so do the module's under summon_full_params(), while
  outside forward and backward the units hold no memory.
Rank 0 writes DIR/result.json (global mean loss per step) and the gathered
parameters as DIR/params_step<k>.npy after step k (and after loading).
--save-at K saves a checkpoint (parameters and AdamW moments) into
DIR/checkpoint after step K; --load CKPT starts from one.
"""

import argparse
import contextlib
import json
import math
import os
import sys

import numpy
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "python"))
import meshrun  # noqa: E402
import meshrun.torch  # noqa: E402
from torch_llama import LlamaForCausalLM  # noqa: E402

TINY = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
GLOBAL_BATCH, SEQ_LEN, STEPS = 4, 8, 3


def batch(step):
    """The global batch of `step`, the same on every world size."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, TINY["vocab_size"], (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


class Checks:
    """The per-step checks, and the forward pre-hooks that see what each
    unit's forward computes with."""

    def __init__(self, model, wrapped, dp):
        self.wrapped, self.dp = wrapped, dp
        self.names = [name for name, _ in model.named_parameters()]
        offsets = numpy.cumsum([0] + [p.numel() for _, p in model.named_parameters()])
        self.span = {name: (offsets[i], offsets[i + 1]) for i, name in enumerate(self.names)}
        self.expected = None  # the gathered parameters after the last step
        self.compared = 0
        for prefix, module in model.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(self._make_hook(prefix))

    def _make_hook(self, prefix):
        def hook(module, inputs):
            if self.expected is None or not torch.is_grad_enabled():
                return
            for name, p in module.named_parameters(prefix, recurse=False):
                begin, end = self.span[name]
                assert torch.equal(p.detach().reshape(-1), self.expected[begin:end]), name
                self.compared += 1
        return hook

    def after_step(self):
        full = self.wrapped.gather_parameters()
        everyone = torch.zeros(self.dp.size, full.numel())
        self.dp.all_gather(full, everyone)
        for rank in range(self.dp.size):
            assert torch.equal(everyone[rank], full), f"rank {rank}'s parameters differ"
        if self.wrapped.sharded:
            for p in self.wrapped.module.parameters():
                assert p.storage().size() == 0, "a unit holds memory outside forward/backward"
            with self.wrapped.summon_full_params():
                for name, p in self.wrapped.module.named_parameters():
                    begin, end = self.span[name]
                    assert torch.equal(p.detach().reshape(-1), full[begin:end]), name
        else:
            flat = self.wrapped.local_parameters
            for name, p in self.wrapped.module.named_parameters():
                offset = 4 * self.span[name][0]
                assert p.data_ptr() == flat.data_ptr() + offset, f"{name} is not in the flat buffer"
                assert p.grad.data_ptr() == flat.grad.data_ptr() + offset, f"{name}'s gradient"
            assert torch.equal(flat, full)
        self.expected = full
        return full


def check_nonfinite_gradients_refused(wrapped):
    """clip_grad_norm_ with error_if_nonfinite raises on every rank, naming
    the first parameter in the module's order that the rank holds a part of,
    and scales nothing; without it the norm is returned."""
    wrapped.zero_grad()
    wrapped.local_parameters.grad.fill_(float("nan"))
    assert math.isnan(wrapped.clip_grad_norm_(1.0))
    names = [name for name, _ in wrapped.module.named_parameters()]
    held = ([s.parameter for s in wrapped.strategy.shard_segments()] if wrapped.sharded
            else range(len(names)))
    try:
        wrapped.clip_grad_norm_(1.0, error_if_nonfinite=True)
    except RuntimeError as error:
        assert f"the gradient of '{names[min(held)]}' is not finite" in str(error), error
    else:
        raise AssertionError("clip_grad_norm_ accepted a NaN gradient")
    wrapped.zero_grad()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--output", required=True)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--load")
    args = parser.parse_intermixed_args()
    torch.set_num_threads(1)
    job = meshrun.init(overrides=["comm.timeout_minutes=1"] + args.overrides)
    dp = job.comm("dp")
    torch.manual_seed(job.rank)
    model = LlamaForCausalLM(TINY)
    wrapped = meshrun.torch.DistributedModule(model, job, units=model.model.layers)
    optimizer = wrapped.adamw(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    checks = Checks(model, wrapped, dp)
    os.makedirs(args.output, exist_ok=True)

    def save(name, array):
        if job.rank == 0:
            numpy.save(os.path.join(args.output, name), array.numpy())

    start = 0
    if args.load:
        start = wrapped.load_checkpoint(args.load, optimizer)
        save(f"params_step{start}.npy", checks.after_step())
    losses = []
    per_rank = GLOBAL_BATCH // dp.size
    for step in range(start, STEPS):
        inputs, targets = batch(step)
        inputs = inputs[dp.rank * per_rank:(dp.rank + 1) * per_rank]
        targets = targets[dp.rank * per_rank:(dp.rank + 1) * per_rank]
        wrapped.zero_grad()
        step_loss = 0.0
        for m in range(per_rank):  # micro-batches of one sequence; the last one syncs
            with contextlib.nullcontext() if m == per_rank - 1 else wrapped.no_sync():
                loss = wrapped(inputs[m:m + 1], targets[m:m + 1]) / per_rank
                loss.backward()
            step_loss += loss.item()
        wrapped.clip_grad_norm_(1.0)
        optimizer.step()
        total = torch.tensor([step_loss])
        dp.all_reduce(total, op="avg")
        losses.append(float(total))
        save(f"params_step{step + 1}.npy", checks.after_step())
        if args.save_at == step + 1:
            wrapped.save_checkpoint(os.path.join(args.output, "checkpoint"), step + 1, optimizer)
        with torch.no_grad():  # an evaluation forward between steps changes nothing
            wrapped(inputs[:1], targets[:1])
    check_nonfinite_gradients_refused(wrapped)
    if wrapped.sharded and STEPS - start > 1:
        assert checks.compared > 0, "the forward pre-hooks compared nothing"
    if job.rank == 0:
        with open(os.path.join(args.output, "result.json"), "w") as f:
            json.dump({"losses": losses, "sharded": wrapped.sharded}, f)


if __name__ == "__main__":
    main()
