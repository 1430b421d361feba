"""The memory fsdp2's buffers may hold at once, predicted from the plan.

Walks the hooks of one optimizer step (one micro-batch per rank, sync) in
the order the model calls them, applying the strategy's buffer rules
(strategies/fsdp2): a gather holds a send block and the gathered blocks in
param_dtype until it completes, then the unit's full float32 parameters
until it reshards (every layer but the last after forward under the default
heuristic, every unit after its backward, the root never after forward); a
unit in backward holds float32 gradients until its reduction starts, which
holds the padded unit and a block in reduce_dtype until it completes.
Gathers start for the unit and its prefetch depth at each pre-hook.

`asap` says when communication completes: at the first poll after it started
(the strategy polls at every hook; on this tiny model collectives finish
well within a layer's compute), or only when waited for (an upper bound).
"""


def unit_sizes(plan, ranks):
    """[(name, full numel, block numel)] of the plan's units in plan order:
    the block is this rank's padded chunk of every parameter (rows / ranks,
    rounded up)."""
    shapes = {p["name"]: p["shape"] for p in plan["model"]["parameters"]}
    sizes = []
    for unit in plan["model"]["units"]:
        full = block = 0
        for name in unit["parameters"]:
            shape = shapes[name]
            row = 1
            for size in shape[1:]:
                row *= size
            full += shape[0] * row
            block += -(-shape[0] // ranks) * row
        sizes.append((unit["name"], full, block))
    return sizes


class _Step:
    def __init__(self, sizes, ranks, param_bytes, reduce_bytes, asap):
        self.full = {name: f for name, f, _ in sizes}
        self.block = {name: b for name, _, b in sizes}
        self.ranks, self.pb, self.rb, self.asap = ranks, param_bytes, reduce_bytes, asap
        self.now = self.peak = 0
        self.gathered, self.gathers, self.grads, self.reductions = set(), [], set(), []

    def add(self, n):
        self.now += n
        self.peak = max(self.peak, self.now)

    def gather_buffers(self, u):
        return (1 + self.ranks) * self.block[u] * self.pb

    def reduction_buffers(self, u):
        return (self.ranks + 1) * self.block[u] * self.rb

    def start_gather(self, u):
        if u not in self.gathered and u not in self.gathers:
            self.add(self.gather_buffers(u))
            self.gathers.append(u)

    def complete_gather(self, u):
        if u in self.gathers:
            self.add(4 * self.full[u])
            self.add(-self.gather_buffers(u))
            self.gathers.remove(u)
            self.gathered.add(u)

    def reshard(self, u):
        if u in self.gathered:
            self.gathered.remove(u)
            self.add(-4 * self.full[u])

    def poll(self):
        if not self.asap:
            return
        for u in sorted(self.gathers, key=list(self.full).index):
            self.complete_gather(u)
        while self.reductions:
            self.add(-self.reduction_buffers(self.reductions.pop(0)))

    def enter(self, u, prefetch):
        self.poll()
        self.start_gather(u)
        for p in prefetch:
            self.start_gather(p)
        self.complete_gather(u)

    def start_reduction(self, u):
        self.add(self.reduction_buffers(u))
        self.reductions.append(u)
        self.grads.remove(u)
        self.add(-4 * self.full[u])


    def grads_for(self, u):
        if u not in self.grads:
            self.grads.add(u)
            self.add(4 * self.full[u])

    def reshard_all(self):
        for u in list(self.full):
            self.complete_gather(u)
            self.reshard(u)


def predicted_peak_buffers(sizes, ranks, param_bytes, reduce_bytes, forward_depth,
                           backward_depth, asap=True):
    """The most bytes the buffers hold at once in a training step with the
    default resharding heuristic (no pipeline)."""
    s = _Step(sizes, ranks, param_bytes, reduce_bytes, asap)
    root = "root"
    layers = [name for name, _, _ in sizes if name != root]
    backward = layers[::-1]
    for _ in range(2):  # the second step starts from what the first left
        s.poll()  # begin_micro_batch
        s.reshard_all()
        s.enter(root, layers[:forward_depth])
        for i, u in enumerate(layers):
            s.enter(u, layers[i + 1:i + 1 + forward_depth])
            s.poll()  # post_forward
            if i < len(layers) - 1:
                s.reshard(u)
        s.poll()  # post_forward(root)
        s.enter(root, backward[:backward_depth])
        s.grads_for(root)
        for i, u in enumerate(backward + [root]):
            if u != root:
                s.enter(u, backward[i + 1:i + 1 + backward_depth])
                s.grads_for(u)
            s.poll()  # post_backward
            s.start_reduction(u)
            s.reshard(u)
        while s.reductions:  # finish_gradients
            s.add(-s.reduction_buffers(s.reductions.pop(0)))
        s.reshard_all()
    return s.peak
