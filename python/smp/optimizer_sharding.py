"""Optimizer-state sharding (config `"shard_optimizer_state": true`, SMP v1.6's name).

Note [Sharded optimizer state]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With AdamW the optimizer state (8 bytes per parameter) is the largest part of the
training state, and without sharding every dp replica holds all of it. With sharding,
the parameters a pp rank holds are divided between the ranks of its dp group, each
parameter whole: each rank's optimizer keeps (and steps) only the parameters it was
given, and after its step every rank sends the values of its own parameters to the
others (one coalesced broadcast per dp rank, in C++), so every replica again holds
every parameter.

- Every torch.optim optimizer that updates each parameter from its own gradient and
  state works unchanged (SGD, Adam, AdamW, RMSprop, Adagrad, ...): a parameter's
  update is the same computation on the same all-reduced gradient, so the sharded run
  equals the unsharded one bit for bit. One that couples parameters (LBFGS) is refused
  by name.
- `clip_grad_norm_` works as before: every rank holds every all-reduced gradient.
- The parameters are divided once, at the first step (after partitioning): in the
  reducer's order, largest first, each to the rank holding the fewest elements so far,
  ties to the lower rank. Every rank of a dp group computes the same division from the
  same shapes.
- The gradients are still all-reduced (every rank ends the backward with every
  gradient); reduce-scattering them, so each rank also holds only its share of the
  gradients, is not built yet.

`optimizer.local_state_dict()` holds this rank's share; `optimizer.state_dict()`
gathers every rank's share (collective over the world).
"""
import torch

from smp import _C, core

__all__ = []

_COUPLED = ("LBFGS",)  # optimizers whose step couples parameters


class Shard:
    """The division of a rank's parameters between its dp group (Note [Sharded
    optimizer state])."""

    def __init__(self, params, dp_size, dp_rank):
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.by_rank = [[] for _ in range(dp_size)]
        load = [0] * dp_size
        order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
        owner = {}
        for i in order:
            r = min(range(dp_size), key=lambda k: (load[k], k))
            owner[i] = r
            load[r] += params[i].numel()
        for i, p in enumerate(params):  # each rank's in the reducer's order
            self.by_rank[owner[i]].append(p)
        self.mine = {id(p) for p in self.by_rank[dp_rank]}
        self.elements = load

    def owns(self, p):
        return id(p) in self.mine

    def restrict(self, optimizer):
        """Leaves in `optimizer` only the parameters this rank steps (every one it does
        not hold at all, on another pp rank, stays: it has no gradient here)."""
        held = {id(p) for r in self.by_rank for p in r}
        optimizer._smp_full_groups = [list(g["params"]) for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if id(p) not in held or self.owns(p)]
        for p in list(optimizer.state):
            if id(p) in held and not self.owns(p):
                del optimizer.state[p]
        # zero_grad() clears every gradient it used to: the others' parameters still
        # get gradients here (all-reduced), which must not pile up across steps.
        others = [p for r in self.by_rank for p in r if not self.owns(p)]
        own_zero_grad = optimizer.zero_grad

        def zero_grad(set_to_none=True):
            own_zero_grad(set_to_none=set_to_none)
            for p in others:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()
        optimizer.zero_grad = zero_grad

    def gather(self):
        """Every rank's stepped parameters to every rank of the dp group (in C++)."""
        group = core.get_dp_process_group()
        with torch.no_grad():
            for r, params in enumerate(self.by_rank):
                if params:
                    _C.broadcast_coalesced(group, params, r)


def enabled():
    return bool(getattr(core.state.cfg, "shard_optimizer_state", False)) and \
        core.dp_size() > 1


def shards():
    """Over how many ranks each pp rank's optimizer state is divided (1: not sharded)."""
    return core.dp_size() if enabled() else 1


def of(optimizer):
    """The optimizer's Shard, or None when it is not sharded."""
    return getattr(optimizer, "_smp_shard", None)


def install(model, optimizer):
    """Divides `model`'s parameters between the dp group and restricts `optimizer` to
    this rank's (once both exist and the model is partitioned)."""
    if optimizer is None or model is None or not model.partitioned or not enabled():
        return
    if of(optimizer) is not None:
        return
    if type(optimizer).__name__ in _COUPLED:
        raise core.ConfigError(
            f"smp: config 'shard_optimizer_state'=true cannot shard {type(optimizer).__name__}, "
            "whose step couples every parameter; use an optimizer that updates each "
            "parameter from its own gradient (SGD, Adam, AdamW, ...) or set it to false")
    params = model.replica.params()
    optimizer._smp_shard = Shard(params, core.dp_size(), core.dp_rank())
    optimizer._smp_shard.restrict(optimizer)


def after_step(optimizer):
    shard = of(optimizer)
    if shard is not None:
        shard.gather()
