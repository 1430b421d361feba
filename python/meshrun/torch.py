"""A torch.nn.Module trained under meshrun's configured strategy (ddp or
fsdp2), driven from module and autograd hooks the way PyTorch's own
DistributedDataParallel and FullyShardedDataParallel drive theirs.

    job = meshrun.init(config, strategy="fsdp2")
    model = meshrun.torch.DistributedModule(model, job, units=model.model.layers)
    optimizer = model.adamw(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for step in ...:
        model.zero_grad()
        for micro_batch in ...:                          # gradient accumulation
            with model.no_sync() if not last else contextlib.nullcontext():
                model(inputs, targets).backward()         # averaged when it returns
        model.clip_grad_norm_(1.0)
        optimizer.step()

Design, and why:

* Flat buffers. Under ddp the module's parameters become views into one flat
  float32 tensor and their .grad views into one flat gradient tensor, set
  once, so autograd accumulates every gradient in place into the buffer the
  strategy all-reduces: no per-parameter copy in or out (DDP's
  gradient_as_bucket_view), and the optimizer updates the buffer itself.

* Units. The root (the wrapped module) is one unit; each block the caller
  names (e.g. the decoder layers, in forward order) is another. A parameter
  belongs to the deepest named block that contains it, else to the root.
  fsdp2 gathers and reduces parameters unit by unit; ddp ignores units.

* ddp hooks. A parameter's gradient is final when its AccumulateGrad node
  has run: torch 1.13 has no post-accumulate-grad hook, so, as DDP's reducer
  does, a hook is registered on that node (reached through
  p.expand_as(p).grad_fn.next_functions[0][0], and referenced here so that
  it lives as long as the parameter) and calls gradient_ready(p); the
  strategy all-reduces a bucket as soon as it is complete, overlapping the
  rest of backward. At the end of backward (an autograd engine callback,
  queued from the first hook that runs) finish_gradients waits for the
  last buckets, so backward() returns with averaged gradients, as in DDP.

* fsdp2 forward. The strategy owns the parameters (only this rank's shard
  between uses). A forward pre-hook of each unit calls pre_forward(u) and
  copies the gathered unit (unit_views) into persistent per-unit torch
  storage that the unit's parameters view. The copy is needed because
  autograd saves views of the weights for backward: the storage those saved
  tensors point at must stay the same object, while the strategy's gathered
  buffer is freed after post_forward and gathered again elsewhere for
  backward. After the unit's forward, post_forward(u), and the storage is
  freed with storage().resize_(0) — FSDP1's technique: the storage object
  survives, with no memory — then re-allocated and refilled before the
  unit's backward. Keeping every unit's storage instead holds a full
  float32 copy of the model on every rank, which is what sharding avoids.
  Measured on tests/bench/python_ddp_vs_torch.py's model (13 MB of
  parameters, 2 ranks, 2 micro-batches): keeping raised each rank's peak
  RSS by 18 MB and left the step time unchanged within the run-to-run
  noise; the refills (20 unit copies a step) cost 13-19 ms of a 1 s step.
  The root's
  storage stays from its pre_forward to the end of backward. Outside
  forward and backward no unit is materialized: the module's parameters
  have no storage (summon_full_params() materializes them).

* fsdp2 backward. The forward post-hook registers a hook on each output
  tensor of the unit; the first to run (the gradient reaching the unit)
  calls pre_backward(u), refills the unit's storage, and points each
  parameter's .grad at its slice of the strategy's unit gradient view
  (zero on the step's first backward, holding the deferred gradients of
  earlier micro-batches otherwise), so autograd accumulates into it in
  place — no copy and no torch-side gradient memory. When the AccumulateGrad
  hooks of all the unit's parameters have run, .grad is released and
  post_backward(u) starts the unit's reduce-scatter while backward goes on.
  The root's post_backward comes last, in the end-of-backward callback,
  which also closes units whose parameters got no gradient. Call order is
  strategy.h's: the root's pre_ first and post_ last.

* Micro-batches. A forward with grad enabled begins a micro-batch; it is
  the step's sync micro-batch unless run inside no_sync() (DDP's rule:
  what counts is where the forward runs). A forward under torch.no_grad()
  is an evaluation: no micro-batch, nothing to reduce.

* Optimizer. adamw() returns a plain torch.optim.AdamW over the memory the
  strategy says this rank updates: the flat parameters under ddp, a torch
  view of the strategy's local shard under fsdp2 (torch.from_numpy over the
  strategy's memory: zero-copy). It steps views of that memory in pieces of
  at most OPTIMIZER_CHUNK elements: one pass of AdamW over a whole 13 MB
  buffer after another runs from L3, pieces run in L2, twice as fast here
  (as fast as torch's loop over the parameters). The pieces follow the
  shard's segments (host.h's meshrun_strategy_shard_segments says which
  parameter each shard element belongs to), so that weight decay, in one
  parameter group, skips 1-D parameters (norm weights, biases), as `meshrun
  train` does; decay_1d=True decays all, like torch.optim.AdamW over
  model.parameters(). The moments are views of two flat buffers of the
  shard's layout, which checkpoints save.

Gradients are zeroed with zero_grad() before a step's first micro-batch
(the strategy's contract). The module must run each unit once per forward
and one backward per forward. Every step leaves replicas equal: under ddp
the module's parameters are the same on every rank; under fsdp2 the
parameters each forward materializes are the gathered full parameters.
"""

import contextlib
import ctypes
import json
import math
import os
import time

import torch
from torch import nn

from . import dlpack, metrics
from ._capi import check, library
from .metrics import peak_rss_bytes
from .strategy import Strategy

ROOT = 0  # the root's unit number; the named blocks are 1..n in forward order
UNIT_HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward")
# Elements per tensor the optimizer steps: 1 MiB of float32, so that AdamW's
# passes over a piece run in the core's L2 cache (twice as fast here as one
# pass after another over the whole flat buffer).
OPTIMIZER_CHUNK = 1 << 18


def _units_of(module, blocks):
    """The unit of each of module.named_parameters(): the deepest block of
    `blocks` that contains it (1-based, in the given order), else ROOT."""
    qualified = {id(m): name for name, m in module.named_modules()}
    unit_of = {}
    for index, block in enumerate(blocks, 1):
        if id(block) not in qualified:
            raise ValueError(f"unit {index} is not a submodule of the wrapped module")
        depth = qualified[id(block)].count(".") + 1
        for p in block.parameters():
            if id(p) in unit_of and unit_of[id(p)][1] == depth:
                raise ValueError(f"a parameter is shared by units {unit_of[id(p)][0]} and "
                                 f"{index}, neither inside the other")
            if id(p) not in unit_of or unit_of[id(p)][1] < depth:
                unit_of[id(p)] = (index, depth)
    return [unit_of.get(id(p), (ROOT, 0))[0] for _, p in module.named_parameters()]


def _free(storage_owner):
    storage_owner.storage().resize_(0)


def matmul_flops_per_token(module, attention=None):
    """What a trained token costs in `module`, as `meshrun train` counts it
    (docs/design.md, "MFU"): 6 FLOPs per weight of every nn.Linear (forward,
    and the two GEMMs of its backward; an embedding lookup is no matmul),
    plus, with attention = (layers, width, seq_len), 12 x layers x width x
    seq_len for attention's score and value matmuls (width: heads x
    head_dim)."""
    weights = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))
    flops = 6 * weights
    if attention is not None:
        layers, width, seq_len = attention
        flops += 12 * layers * width * seq_len
    return flops


class DistributedModule(nn.Module):
    """`module` under the strategy of `runtime`'s config (a joined
    meshrun.Runtime): distributed.strategy "ddp" or "fsdp2". `units`: the
    blocks fsdp2 gathers one at a time, in forward order (e.g.
    model.model.layers); the rest of the module is the root unit.

    Creating it is collective over the data-parallel ranks; every rank
    starts from data-parallel rank 0's parameters. The module's parameters
    are rebound to meshrun's buffers (see the module docstring).
    """

    def __init__(self, module, runtime, units=()):
        super().__init__()
        self.module = module
        blocks = list(units)
        named = list(module.named_parameters())
        self._params = [p for _, p in named]
        self._names = [name for name, _ in named]
        self._rank = runtime.rank
        self._unit_of = _units_of(module, blocks)
        self.num_units = len(blocks) + 1
        qualified = {id(m): name for name, m in module.named_modules()}
        self._unit_names = ["root"] + [qualified[id(block)] for block in blocks]
        self._computing = {}  # unit -> trace time its compute began (while tracing)
        shapes = [tuple(p.shape) for p in self._params]
        self._offsets = [0]
        for p in self._params:
            self._offsets.append(self._offsets[-1] + p.numel())
        numel = self._offsets[-1]

        self._frozen = [i for i, p in enumerate(self._params) if not p.requires_grad]
        self._accumulators = []  # the AccumulateGrad nodes hooked: keep them alive
        # (made while the parameters have memory; rebinding .data keeps them)
        for index, p in enumerate(self._params):
            if p.requires_grad:
                node = p.expand_as(p).grad_fn.next_functions[0][0]
                node.register_hook(self._make_accumulated_hook(index))
                self._accumulators.append(node)
        with torch.no_grad():
            values = torch.empty(numel)
            for p, begin, end in self._spans():
                values[begin:end].copy_(p.reshape(-1))
        gradients = torch.zeros(numel)
        self.strategy = Strategy(runtime, values, gradients, [n for n, _ in named], shapes,
                                 self._unit_of, root_unit=ROOT, num_units=self.num_units)
        self.sharded = self.strategy.sharded
        self.strategy_seconds = 0.0  # time inside strategy calls: metrics' comm_wait_s
        self.grad_sync_seconds = 0.0  # of which in finish_gradients: grad_sync_wait_s
        self._start_rss = peak_rss_bytes()
        self._activations = self._activations_peak = 0  # bytes kept for backward
        if self.sharded:
            self._make_unit_storage()
            del values, gradients  # the strategy holds its shard now
            local_params, local_grads = self.strategy.local_shard()
            self.local_parameters = torch.from_numpy(local_params)
            self._local_gradients = torch.from_numpy(local_grads)
        else:
            with torch.no_grad():
                for p, begin, end in self._spans():
                    p.data = values[begin:end].view(p.shape)
                    p.grad = gradients[begin:end].view(p.shape)
            self.local_parameters = values
            self._local_gradients = gradients
        self.local_parameters.grad = self._local_gradients
        self._timed(self.strategy.broadcast_parameters)

        for unit, block in enumerate(blocks, 1):
            block.register_forward_pre_hook(self._make_pre_forward_hook(unit))
            block.register_forward_hook(self._make_post_forward_hook(unit))

        self._sync_enabled = True
        self._micro_batch = None  # None, or whether the open micro-batch syncs
        self._in_backward = False
        self._backward_units = set()  # units between pre_backward and post_backward
        self._pending = [0] * self.num_units
        self._optimizer_chunks = []  # (parameter view, gradient view) made by adamw()

    # ---- layout ----

    def _spans(self):
        """(parameter, begin, end) of each parameter in the flat layout."""
        for index, p in enumerate(self._params):
            yield p, self._offsets[index], self._offsets[index + 1]

    def _make_unit_storage(self):
        """Per-unit flat storage that the unit's parameters view, freed."""
        self._unit_flat, self._unit_members = [], []
        for unit in range(self.num_units):
            members = [i for i in range(len(self._params)) if self._unit_of[i] == unit]
            flat = torch.empty(sum(self._params[i].numel() for i in members))
            begin = 0
            for i in members:
                p = self._params[i]
                p.data = flat[begin:begin + p.numel()].view(p.shape)
                begin += p.numel()
            _free(flat)
            self._unit_flat.append(flat)
            self._unit_members.append(members)
        self._materialized = [False] * self.num_units

    def _timed(self, call, *args):
        start, traced = time.perf_counter(), metrics.trace_now() if metrics._tracing else 0.0
        try:
            return call(*args)
        finally:
            self.strategy_seconds += time.perf_counter() - start
            if traced:  # named as meshrun train names them
                name = call.__name__
                if name in UNIT_HOOKS:
                    name = f"strategy {name} {args[0]}"
                metrics.trace_span(name, "comm", traced, metrics.trace_now())

    # A unit's compute in the trace, as meshrun train records it: from the
    # end of its pre_ hook to the start of its post_ hook, "forward NAME" or
    # "backward NAME" (the strategy's work in the hooks is traced apart).
    def _computing_begins(self, unit):
        if metrics._tracing:
            self._computing[unit] = metrics.trace_now()

    def _computing_ends(self, unit, direction):
        began = self._computing.pop(unit, None)
        if began is not None and metrics._tracing:
            metrics.trace_span(f"{direction} {self._unit_names[unit]}", "compute", began,
                               metrics.trace_now())

    # ---- forward ----

    def forward(self, *args, **kwargs):
        training = torch.is_grad_enabled()
        if training:
            self._begin_micro_batch()
        if self.sharded:
            self._pre_forward(ROOT)
        self._computing_begins(ROOT)
        if training:
            with self._metered_activations():
                output = self.module(*args, **kwargs)
        else:
            output = self.module(*args, **kwargs)
        self._computing_ends(ROOT, "forward")
        if self.sharded:
            self._timed(self.strategy.post_forward, ROOT)
            if not training:
                self._release(ROOT)
        if training:
            self._hook_outputs(output, ROOT)
        return output

    @contextlib.contextmanager
    def _metered_activations(self):
        """What autograd keeps of this forward for the backward, in bytes:
        metrics' mem.activations (the last forward's) and activations_peak.
        Parameters it keeps are not activations; a tensor kept twice counts
        once."""
        parameters = {id(p) for p in self._params}
        seen = set()

        def pack(tensor):
            owner = tensor if tensor._base is None else tensor._base
            key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
            if id(owner) not in parameters and key not in seen:
                seen.add(key)
                self._activations += tensor.numel() * tensor.element_size()
            return tensor

        self._activations = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self._activations_peak = max(self._activations_peak, self._activations)

    def memory_use(self, optimizer=None):
        """This rank's bytes as metrics.jsonl's "mem" says them: the local
        shard's float32 parameters and gradients, the AdamW moments of an
        optimizer made by adamw(), the strategy's buffers, what the last
        forward kept for backward, and the process's peak RSS (now, and when
        the module was made)."""
        local = self.local_parameters.numel() * 4
        buffers, peak, reserved = self.strategy.memory_use()
        moments = getattr(optimizer, "meshrun_moments", {}) if optimizer is not None else {}
        return {"params": local, "grads": local,
                "optimizer": sum(m.numel() * m.element_size() for m in moments.values()),
                "buffers": buffers, "buffers_peak": peak, "buffers_reserved": reserved,
                "activations": self._activations, "activations_peak": self._activations_peak,
                "peak_rss": peak_rss_bytes(), "peak_rss_at_start": self._start_rss}

    def _begin_micro_batch(self):
        if self._micro_batch is not None:
            raise RuntimeError("a forward with grad enabled began a micro-batch whose backward "
                               "never ran; run evaluation forwards under torch.no_grad()")
        self._micro_batch = self._sync_enabled
        self._timed(self.strategy.begin_micro_batch, self._micro_batch)
        if not self.sharded:
            for index in self._frozen:  # no gradient will come: ready as they are (zero)
                self._timed(self.strategy.gradient_ready, index)

    @contextlib.contextmanager
    def no_sync(self):
        """Forwards inside accumulate their gradients locally; the step's
        last micro-batch runs outside (DDP's no_sync)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _pre_forward(self, unit):
        self._timed(self.strategy.pre_forward, unit)
        self._materialize(unit)

    def _materialize(self, unit):
        """Fills the unit's torch storage from the strategy's gathered view,
        unless it still holds them (the root from forward to backward: the
        shard changes only at the optimizer step, after both)."""
        if self._materialized[unit]:
            return
        parameters, _ = self.strategy.unit_views(unit)
        flat = self._unit_flat[unit]
        flat.storage().resize_(flat.numel())
        self._materialized[unit] = True
        with torch.no_grad():
            flat.copy_(torch.from_numpy(parameters))

    def _release(self, unit):
        if self._materialized[unit]:
            _free(self._unit_flat[unit])
            self._materialized[unit] = False

    def _make_pre_forward_hook(self, unit):
        def hook(module, inputs):
            if self.sharded:
                self._pre_forward(unit)
            self._computing_begins(unit)
        return hook

    def _make_post_forward_hook(self, unit):
        def hook(module, inputs, output):
            self._computing_ends(unit, "forward")
            if not self.sharded:
                return
            self._timed(self.strategy.post_forward, unit)
            self._release(unit)
            if torch.is_grad_enabled():
                self._hook_outputs(output, unit)
        return hook

    def _hook_outputs(self, output, unit):
        """Registers the unit's start-of-backward hook on each output tensor
        that requires grad; the first to run in a backward calls it."""
        tensors = []
        stack = [output]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                if item.requires_grad:
                    tensors.append(item)
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, dict):
                stack.extend(item.values())
        for tensor in tensors:
            tensor.register_hook(self._make_backward_start_hook(unit))

    # ---- backward ----

    def _make_backward_start_hook(self, unit):
        def hook(grad):
            if unit == ROOT and not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
                if not self.sharded:  # ddp: the backward as one span, the root's
                    self._computing_begins(ROOT)
            if self.sharded and unit not in self._backward_units:
                self._pre_backward(unit)
        return hook

    def _pre_backward(self, unit):
        self._timed(self.strategy.pre_backward, unit)
        self._backward_units.add(unit)
        self._materialize(unit)
        _, gradients = self.strategy.unit_views(unit)
        gradients = torch.from_numpy(gradients)
        begin = 0
        pending = 0
        for i in self._unit_members[unit]:
            p = self._params[i]
            p.grad = gradients[begin:begin + p.numel()].view(p.shape)
            begin += p.numel()
            pending += p.requires_grad
        self._pending[unit] = pending
        self._computing_begins(unit)

    def _post_backward(self, unit):
        self._computing_ends(unit, "backward")
        for i in self._unit_members[unit]:
            self._params[i].grad = None  # the strategy's memory, gone after post_backward
        self._backward_units.discard(unit)
        self._timed(self.strategy.post_backward, unit)
        self._release(unit)

    def _make_accumulated_hook(self, index):
        def hook(grad_inputs, grad_outputs):
            if self._micro_batch is None:
                return
            if not self.sharded:
                self._timed(self.strategy.gradient_ready, index)
                return
            unit = self._unit_of[index]
            if unit != ROOT and unit in self._backward_units:
                self._pending[unit] -= 1
                if self._pending[unit] == 0:
                    self._post_backward(unit)
        return hook

    def _end_backward(self):
        """The autograd engine's callback after the whole backward."""
        self._in_backward = False
        if not self.sharded:
            self._computing_ends(ROOT, "backward")
        else:
            for unit in sorted(self._backward_units - {ROOT}, reverse=True):
                self._post_backward(unit)
            if ROOT in self._backward_units:
                self._post_backward(ROOT)
        sync, self._micro_batch = self._micro_batch, None
        if sync:
            before = self.strategy_seconds
            self._timed(self.strategy.finish_gradients)
            self.grad_sync_seconds += self.strategy_seconds - before

    # ---- the step ----

    def zero_grad(self, set_to_none=False):
        """Zeroes the gradients this rank's optimizer reads (the flat buffer
        under ddp, the local shard's under fsdp2); call it before a step's
        first micro-batch. The buffers stay: set_to_none is ignored."""
        # The gradient views stay attached even after an optimizer's set_to_none.
        self.local_parameters.grad = self._local_gradients
        for chunk, gradient in self._optimizer_chunks:
            chunk.grad = gradient
        self._local_gradients.zero_()

    def clip_grad_norm_(self, max_norm, error_if_nonfinite=False):
        """Scales the gradients so that their global L2 norm is at most
        max_norm (torch.nn.utils.clip_grad_norm_'s rule); returns the norm
        before clipping. Collective. With error_if_nonfinite (torch's flag),
        a NaN or infinite norm raises RuntimeError on every rank alike,
        naming the first parameter whose gradient on this rank is not
        finite, and nothing is scaled."""
        norm = self._timed(self.strategy.gradient_norm_squared) ** 0.5
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {norm}, so they cannot be "
                               f"clipped{self._first_nonfinite_gradient()}")
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0:
            self._local_gradients.mul_(coefficient)
        return norm

    def _first_nonfinite_gradient(self):
        """"; the gradient of 'NAME' is not finite on rank R" for the first
        parameter, in the module's order, whose local gradient is not."""
        for segment in sorted(self.strategy.shard_segments(), key=lambda s: s.parameter):
            begin = segment.local_begin
            if not torch.isfinite(self._local_gradients[begin:begin + segment.count]).all():
                return (f"; the gradient of '{self._names[segment.parameter]}' is not finite on "
                        f"rank {self._rank}")
        return ""

    def _chunks(self, decay_1d):
        """(begin, end, decayed) element ranges of local_parameters that the
        optimizer steps: the shard's segments, adjacent ones of the same
        decay merged, cut into pieces of at most OPTIMIZER_CHUNK elements."""
        runs = []
        for segment in self.strategy.shard_segments():
            decayed = decay_1d or self._params[segment.parameter].dim() > 1
            begin, end = segment.local_begin, segment.local_begin + segment.count
            if runs and runs[-1][1] == begin and runs[-1][2] == decayed:
                runs[-1][1] = end
            else:
                runs.append([begin, end, decayed])
        return [(b, min(b + OPTIMIZER_CHUNK, end), decayed) for begin, end, decayed in runs
                for b in range(begin, end, OPTIMIZER_CHUNK)]

    def adamw(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, decay_1d=False):
        """torch.optim.AdamW over local_parameters; weight decay skips 1-D
        parameters unless decay_1d (see the module docstring). Its moments
        live in two flat buffers of the local shard's layout
        (optimizer.meshrun_moments), which checkpoints save."""
        moments = {name: torch.zeros_like(self.local_parameters)
                   for name in ("exp_avg", "exp_avg_sq")}
        groups, states = {True: [], False: []}, {}
        self._optimizer_chunks = []
        for begin, end, decayed in self._chunks(decay_1d):
            chunk = self.local_parameters[begin:end]
            chunk.grad = self._local_gradients[begin:end]
            groups[decayed].append(chunk)
            self._optimizer_chunks.append((chunk, chunk.grad))
            # AdamW finds its state made: the moments are views of the flat buffers.
            states[chunk] = {"step": torch.tensor(0.0),
                             **{name: m[begin:end] for name, m in moments.items()}}
        optimizer = torch.optim.AdamW(
            [{"params": groups[True]}, {"params": groups[False], "weight_decay": 0.0}],
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        optimizer.state.update(states)
        optimizer.meshrun_moments = moments
        return optimizer

    # ---- full parameters and checkpoints ----

    def export_safetensors(self, directory, bfloat16=False, config=None):
        """The full parameters as DIRECTORY/model.safetensors, with the
        module's names and shapes, written on rank 0 by the writer `meshrun
        train` exports with (Hugging Face's format; F32, or BF16 when
        bfloat16). `config`, the model's Hugging Face config as a dict (e.g.
        transformers' model.config.to_dict(), or the config.json `meshrun
        train` exported), is written beside it as config.json, its
        torch_dtype saying the weights' dtype, as `meshrun train` writes it.
        Collective; outside a step."""
        full = self.gather_parameters().numpy()
        if self._rank != 0:
            return
        os.makedirs(directory, exist_ok=True)
        if config is not None:
            config = dict(config, torch_dtype="bfloat16" if bfloat16 else "float32")
            with open(os.path.join(directory, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
        shapes = [tuple(p.shape) for p in self._params]
        names = (ctypes.c_char_p * len(self._names))(*(n.encode() for n in self._names))
        ndims = (ctypes.c_int32 * len(shapes))(*(len(s) for s in shapes))
        extents = [e for s in shapes for e in s]
        flat = (ctypes.c_int64 * max(len(extents), 1))(*extents)
        values = dlpack.borrow(full, "export_safetensors: values")
        check(library().meshrun_write_safetensors(
            os.fsencode(os.path.join(directory, "model.safetensors")), len(shapes), names, ndims,
            flat, values.pointer, 1 if bfloat16 else 0))

    def gather_parameters(self):
        """Every parameter in the flat layout (named_parameters() order), as
        a new float32 tensor: gathered under fsdp2, copied under ddp.
        Collective; outside a step."""
        return torch.from_numpy(self.strategy.gather_parameters())

    @contextlib.contextmanager
    def summon_full_params(self):
        """Inside, the module's parameters hold the full current values
        (fsdp2: gathered, collective; ddp: they always do). Changes made
        inside are discarded under fsdp2."""
        if not self.sharded:
            yield
            return
        full = self.gather_parameters()
        for unit in range(self.num_units):
            self._unit_flat[unit].storage().resize_(self._unit_flat[unit].numel())
            self._materialized[unit] = True
        with torch.no_grad():
            for p, begin, end in self._spans():
                p.copy_(full[begin:end].view(p.shape))
        try:
            yield
        finally:
            for unit in range(self.num_units):
                self._release(unit)

    def save_checkpoint(self, directory, step, optimizer=None):
        """A sharded checkpoint of the parameters (and the moments of an
        optimizer made by adamw()), loadable on any world size and strategy
        (meshrun train's format); collective."""
        moments = optimizer.meshrun_moments if optimizer is not None else {}
        self.strategy.save_checkpoint(directory, step, moments)

    def load_checkpoint(self, directory, optimizer=None):
        """Loads a checkpoint saved by save_checkpoint (any world size or
        strategy) into the parameters and an optimizer made by adamw();
        returns its step, which becomes the optimizer's step count."""
        moments = optimizer.meshrun_moments if optimizer is not None else {}
        step = self.strategy.load_checkpoint(directory, moments)
        if optimizer is not None:
            for state in optimizer.state.values():
                state["step"] = torch.tensor(float(step))
        return step

