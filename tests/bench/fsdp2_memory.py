"""The memory the sharding engine's buffers (fsdp2, megatron_fsdp) may hold
at once, predicted from the plan.

Walks the hooks of one optimizer step (its micro-batches, the last one
sync) in the order the model calls them, applying the strategy's buffer rules
(strategies/sharding; a unit's parameters are cut flat into one chunk per
rank, the unit padded to ranks x chunk): a gather holds a send chunk
(unless param_dtype is float32) and the padded unit in param_dtype until it
completes, then the unit's full float32 parameters (in float32 the receive
buffer itself, padding included; in bfloat16, the only 2-byte param_dtype
walked here, the padded receive buffer beside them, which the matmuls read)
until it reshards (every layer but the
last after forward under the default heuristic, every unit after its
backward, the root never after forward); a unit in backward holds its
padded float32 gradients until its reduction starts, which holds the padded
unit (in float32 the gradients themselves) and a chunk in reduce_dtype
until it completes.
Gathers start for the unit and its prefetch depth at each pre-hook.
Kept gathered (megatron_fsdp's ZeRO-1 and -2), no unit reshards before the
step ends; deferred (fsdp2's default, ZeRO-1), gradients accumulate whole
over the micro-batches and are reduced in the last.

ZeRO-0 (megatron_fsdp's zero_dp_strategy 0) shards over a group of one
and reduces over the replicas: a reduction holds one unit in reduce_dtype,
the all-reduce's buffer. With double buffering (fsdp_double_buffer) the
layer units are gathered into two buffers of the largest layer, held from
setup on, and the root into a buffer of its own.

`progress` says when communication completes, as the strategy sees it at
its polls (every hook polls):
- "asap": at the first poll after it started (a lower bound);
- "serial": once a later-started operation has been waited for; the comm
  backend runs collectives one at a time in the order they were started,
  so that much progress is certain (the prediction);
- "waited": only when waited for itself (an upper bound).
"""


def unit_sizes(plan, ranks):
    """[(name, full numel, chunk numel)] of the plan's units in plan order:
    the chunk is what each rank holds, the unit's elements / ranks rounded
    up."""
    shapes = {p["name"]: p["shape"] for p in plan["model"]["parameters"]}
    sizes = []
    for unit in plan["model"]["units"]:
        full = 0
        for name in unit["parameters"]:
            numel = 1
            for size in shapes[name]:
                numel *= size
            full += numel
        sizes.append((unit["name"], full, -(-full // ranks)))
    return sizes


class _Step:
    def __init__(self, sizes, ranks, param_bytes, reduce_bytes, progress, replicas=1,
                 double_buffer=False):
        self.full = {name: f for name, f, _ in sizes}
        self.chunk = {name: c for name, _, c in sizes}
        self.padded = {name: ranks * c for name, _, c in sizes}
        self.ranks, self.pb, self.rb, self.progress = ranks, param_bytes, reduce_bytes, progress
        self.replicated_only = ranks == 1 and replicas > 1
        self.slotted = {name for name in self.full if name != "root"} if double_buffer else set()
        self.now = self.peak = 0
        if self.slotted:
            self.add(2 * 4 * max(self.padded[name] for name in self.slotted))
        self.gathered, self.grads = set(), set()
        self.gathers, self.reductions = {}, []  # with the order they were started in
        self.started = self.waited = 0

    def add(self, n):
        self.now += n
        self.peak = max(self.peak, self.now)

    def gather_buffers(self, u):
        # A float32 gather sends straight from the shard.
        sends = 0 if self.pb == 4 else 1
        return (sends + self.ranks) * self.chunk[u] * self.pb

    def reduction_buffers(self, u):
        buffers = 1 if self.replicated_only else self.ranks + 1
        return buffers * self.chunk[u] * self.rb

    def parameter_bytes(self, u):
        if u in self.slotted:
            return 0
        # A float32 gather's receive buffer becomes the parameters.
        return 4 * (self.padded[u] if self.pb == 4 else self.full[u])

    def received_bytes(self, u):
        # A bfloat16 gather keeps its receive buffer until the unit reshards.
        return 0 if self.pb == 4 else self.ranks * self.chunk[u] * self.pb

    def start(self):
        self.started += 1
        return self.started

    def complete(self, started):
        return {"asap": True, "serial": started <= self.waited, "waited": False}[self.progress]

    def start_gather(self, u):
        if u not in self.gathered and u not in self.gathers:
            self.add(self.gather_buffers(u))
            self.gathers[u] = self.start()

    def complete_gather(self, u):
        if u in self.gathers:
            self.waited = max(self.waited, self.gathers.pop(u))
            if self.pb == 4 and u not in self.slotted:
                # The receive buffer becomes the parameters.
                self.add(self.parameter_bytes(u) - self.gather_buffers(u))
            else:
                self.add(self.parameter_bytes(u))
                self.add(self.received_bytes(u) - self.gather_buffers(u))
            self.gathered.add(u)

    def reshard(self, u):
        if u in self.gathered:
            self.gathered.remove(u)
            self.add(-self.parameter_bytes(u) - self.received_bytes(u))

    def poll(self):
        while self.reductions and self.complete(self.reductions[0][1]):
            self.finish_reduction()
        for u in [u for u in self.full if u in self.gathers]:
            if self.complete(self.gathers[u]):
                self.complete_gather(u)

    def finish_reduction(self):
        u, started = self.reductions.pop(0)
        self.waited = max(self.waited, started)
        self.add(-self.reduction_buffers(u))

    def enter(self, u, prefetch):
        self.poll()
        self.start_gather(u)
        for p in prefetch:
            self.start_gather(p)
        self.complete_gather(u)

    def start_reduction(self, u):
        self.grads.remove(u)
        if self.rb == 4:
            # float32 gradients are handed over as the send buffer.
            self.add(self.reduction_buffers(u) - 4 * self.padded[u])
        else:
            self.add(self.reduction_buffers(u))
            self.add(-4 * self.padded[u])
        self.reductions.append((u, self.start()))

    def grads_for(self, u):
        if u not in self.grads:
            self.grads.add(u)
            self.add(4 * self.padded[u])

    def reshard_all(self):
        for u in list(self.full):
            self.complete_gather(u)
            self.reshard(u)


def predicted_peak_buffers(sizes, ranks, param_bytes, reduce_bytes, forward_depth,
                           backward_depth, progress="serial", keep_gathered=False,
                           micro_batches=1, defer=True, replicas=1, double_buffer=False):
    """The most bytes the buffers hold at once in a training step with the
    default resharding heuristic (no pipeline), overlapped reductions."""
    s = _Step(sizes, ranks, param_bytes, reduce_bytes, progress, replicas, double_buffer)
    layers = [name for name, _, _ in sizes if name != "root"]
    for _ in range(2):  # the second step starts from what the first left
        for m in range(micro_batches):
            s.poll()  # begin_micro_batch
            if m == 0:
                s.reshard_all()
            _forward(s, layers, forward_depth, keep_gathered)
            reduces = m == micro_batches - 1 or not defer
            _backward(s, layers[::-1], backward_depth, keep_gathered, reduces)
        while s.reductions:  # finish_gradients
            s.finish_reduction()
        s.reshard_all()
    return s.peak


def _forward(s, layers, depth, keep_gathered):
    s.enter("root", layers[:depth])
    for i, u in enumerate(layers):
        s.enter(u, layers[i + 1:i + 1 + depth])
        s.poll()  # post_forward
        if i < len(layers) - 1 and not keep_gathered:
            s.reshard(u)
    s.poll()  # post_forward(root)


def _backward(s, backward, depth, keep_gathered, reduces):
    s.enter("root", backward[:depth])
    s.grads_for("root")
    for i, u in enumerate(backward + ["root"]):
        if u != "root":
            s.enter(u, backward[i + 1:i + 1 + depth])
            s.grads_for(u)
        s.poll()  # post_backward
        if reduces:
            s.start_reduction(u)
        if not keep_gathered:
            s.reshard(u)
