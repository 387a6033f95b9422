"""Optimizer-state sharding (config `"shard_optimizer_state": true`, SMP v1.6's name).

Note [Sharded optimizer state]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With AdamW the optimizer state (8 bytes per parameter) is the largest part of the
training state, and without sharding every dp replica holds all of it. With sharding,
the parameters a pp rank holds are divided between the ranks of its dp group, each
parameter whole:
- the reducer reduces each gradient to the one rank that steps it (a reduce-scatter
  with the owners' shares, overlapped with backward like the allreduce it replaces,
  Note [Reduce to owner] in smp_core/detail/reducer_default_hooks.cpp); the others'
  .grad is None after the step's reduction, so a rank holds only its share of the
  gradients from then to the next backward;
- each rank's optimizer keeps (and steps) only the parameters it was given;
- its step runs round by round (each rank's share in runs of the bucket size), and
  each round's stepped parameters go from their rank to the rest of the dp group while
  the next round is stepped (C++ `ShareExchange`: the broadcasts are in flight while
  the optimizer computes, at most two rounds at once), so every replica again holds
  every parameter. Stepping a share in parts is the same computation: torch.optim's
  optimizers keep their state (the step count included) per parameter, and their
  step hooks run once per round.

- Every torch.optim optimizer that updates each parameter from its own gradient and
  state works unchanged (SGD, Adam, AdamW, RMSprop, Adagrad, Adafactor, ...): a
  parameter's update is the same computation on the same reduced gradient. One that
  couples parameters (LBFGS) is refused by name.
- Tied parameters (partitions > 1, summed across their pp holders after the step) are
  all-reduced as before: every holder needs their gradient.
- `model.clip_grad_norm_` (smp.clip_grad_norm_, and torch's on the model's parameters:
  Note [torch's clip on the whole model]) counts each gradient on the rank that keeps
  it and sums over every rank.
- Comm hooks reduce whole buckets; registering one with sharding raises.
- The parameters are divided once, at partitioning: in the reducer's order, largest
  first, each to the rank holding the fewest elements so far, ties to the lower rank.
  Every rank of a dp group computes the same division from the same shapes.

`optimizer.local_state_dict()` holds this rank's share; `optimizer.state_dict()`
gathers every rank's share (collective over the world).

Note [Sharded tp slices]
~~~~~~~~~~~~~~~~~~~~~~~~
Under tensor_parallel_degree > 1 the dp group spans tp x rdp ranks, and a distributed
parameter (`_smp_tp_dim`) is a different slice on each tp rank: only its rdp group
(the ranks with the same tp rank) holds the same slice and reduces its gradient (Note
[Slices reduce over their rdp group] in smp_core/detail/reducer_build.cpp). So:
- slices are divided between the rdp group, by the same rule (every tp rank's slices
  have the same shapes, so every rdp group divides alike), and a slice's owner given to
  the reducer is an rdp rank: its gradient is reduced to that rank over the rdp group;
- the other parameters are divided between the dp group as without tp, each dp rank
  starting with the elements of the slices its rdp rank was given (the loads balance);
- a step exchanges the stepped unsliced parameters over the dp group, then the stepped
  slices over the rdp group, each in rounds as below (every rank issues both, in this
  order, on both groups);
- `model.clip_grad_norm_` counts each gradient on the rank that keeps it and sums over
  every rank: each slice once per tp rank (once per rdp group), each replicated
  gradient once per stage, which is the norm of Note [Norm over tp slices].
- a slice has one name on every tp rank, so state is never merged by name across tp
  ranks: `optimizer.local_state_dict()` gathering the dp group's shares takes a slice's
  state from this tp rank's shares only, and `smp.load(f, partial=True)` of the shares
  (`v3=True`) reads every one and merges them as tp parts (smp/checkpoint/_read.py),
  as resume_from_checkpoint does; the entries a partial load lacks (another stage's
  part holds them) are exchanged over the world, a slice's only between ranks of one
  tp rank (model_state.exchange's tags).
Each rank's optimizer state is then about (replicated + tp x sliced) / dp of a stage's
elements, against replicated + sliced unsharded.

Note [Steps in rounds]
~~~~~~~~~~~~~~~~~~~~~~
A sharded step calls the optimizer's own step once per round, each time with a part
of the share in its groups, and not at all on a rank whose share has no parameter in
a round. An optimizer whose step needs one quantity over all its parameters (smp.
optimizers.FusedLamb's global gradient norm, a collective: Note [LAMB's global norm]
in smp/optimizers.py) would compute it per round, from a part, and not on every rank.
So an optimizer may define `_smp_whole_step()`, a context manager: the sharded step
enters it once, on every rank, after the closure and before the first round, with
the whole share in the groups, and leaves it after the last round.
"""
import contextlib

import torch

import smp._C as _C
from smp import ranks
from smp.groups import get_dp_process_group, get_rdp_process_group
from smp.process_state import state

__all__ = []

_COUPLED = ("LBFGS",)  # optimizers whose step couples parameters


def check_hook(hook):
    """Note [Reduce to owner]: a comm hook reduces whole buckets, which sharding
    replaces by a reduction to each gradient's owner. Raises on every rank (each
    registers, with the same config)."""
    if enabled():
        name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or repr(hook)
        raise _C.ConfigError(
            f"smp: register_comm_hook(hook={name}): with optimizer-state sharding (config "
            "'shard_optimizer_state'=true) each gradient is reduced to the one rank that "
            "steps it (a reduce-scatter), and a comm hook reduces whole buckets; allowed "
            "with sharding: no hook (the default reduction). Set 'shard_optimizer_state' "
            "to false to use this hook")


class _Division:
    """Parameters divided whole between `size` ranks of one group: in the reducer's
    order, largest first, each to the rank holding the fewest elements so far (`load`:
    elements already there), ties to the lower rank."""

    def __init__(self, params, size, load):
        self.by_rank = [[] for _ in range(size)]
        load = list(load)
        order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
        owner = {}
        for i in order:
            r = min(range(size), key=lambda k: (load[k], k))
            owner[i] = r
            load[r] += params[i].numel()
        for i, p in enumerate(params):  # each rank's in the reducer's order
            self.by_rank[owner[i]].append(p)
        self.owner = {id(p): owner[i] for i, p in enumerate(params)}
        self.load = load
        self._rounds = {}  # cap_bytes -> rounds(cap_bytes): the shares never change

    def rounds(self, cap_bytes):
        """Round k: each rank's k-th run of its share (reducer order) of at most
        `cap_bytes` (a larger parameter alone); the same on every rank."""
        if cap_bytes in self._rounds:
            return self._rounds[cap_bytes]
        runs = []
        for params in self.by_rank:
            mine, size = [[]], 0
            for p in params:
                b = p.numel() * p.element_size()
                if mine[-1] and size + b > cap_bytes:
                    mine.append([])
                    size = 0
                mine[-1].append(p)
                size += b
            runs.append(mine if mine[-1] else [])
        rounds = [[r[k] if k < len(r) else [] for r in runs]
                  for k in range(max(len(r) for r in runs))]
        self._rounds[cap_bytes] = rounds
        return rounds


class Shard:
    """The division of a rank's parameters between its dp group (Note [Sharded
    optimizer state]); under tensor parallelism tp slices between its rdp group (Note
    [Sharded tp slices])."""

    def __init__(self, params, dp_size, dp_rank, replicated=(), sliced=(), rdp_of=None):
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self._replicated = {id(p) for p in replicated}
        slice_ids = {id(p) for p in sliced} - self._replicated
        self._order = list(params)
        # Note [Sharded tp slices]: the slices first, over the rdp group; each dp rank
        # then starts the others' division with its rdp rank's slice elements.
        rdp_of = list(rdp_of) if rdp_of is not None else list(range(dp_size))
        self.rdp_rank, self.rdp_size = rdp_of[dp_rank], max(rdp_of) + 1
        slices = [p for p in params if id(p) in slice_ids]
        self._slices = _Division(slices, self.rdp_size, [0] * self.rdp_size)
        whole = [p for p in params if id(p) not in slice_ids]
        self._whole = _Division(whole, dp_size, [self._slices.load[k] for k in rdp_of])
        self.by_rank = self._whole.by_rank  # the dp ranks' shares of the unsliced ones
        self.mine = ({id(p) for p in self._whole.by_rank[dp_rank]} |
                     {id(p) for p in self._slices.by_rank[self.rdp_rank]})
        self._held = {id(p) for p in params}
        self.elements = self._whole.load  # per dp rank, slices included

    def owns(self, p):
        return id(p) in self.mine

    def keeps(self, p):
        """Whether this rank's optimizer keeps `p`'s state: its own share, and every
        parameter the division does not cover (restrict leaves those)."""
        return id(p) in self.mine or id(p) not in self._held

    def grad_owners(self):
        """Per parameter (the reducer's order), the rank that keeps its reduced gradient
        (a dp rank; for a tp slice, an rdp rank), or -1 where every rank does (Note
        [Reduce to owner])."""
        def owner(p):
            if id(p) in self._replicated:
                return -1
            got = self._slices.owner.get(id(p))
            return got if got is not None else self._whole.owner[id(p)]
        return [owner(p) for p in self._order]

    def restrict(self, optimizer):
        """Leaves in `optimizer` only the parameters this rank steps (every one it does
        not hold at all, on another pp rank, stays: it has no gradient here)."""
        held = self._held
        optimizer._smp_full_groups = [list(g["params"]) for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if id(p) not in held or self.owns(p)]
        for p in list(optimizer.state):
            if id(p) in held and not self.owns(p):
                del optimizer.state[p]
        # zero_grad() clears every gradient it used to: the others' parameters still
        # get gradients here (all-reduced), which must not pile up across steps.
        others = [p for p in self._order if not self.owns(p)]
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

    def rounds(self, cap_bytes):
        """The unsliced parameters' rounds (_Division.rounds), over the dp group."""
        return self._whole.rounds(cap_bytes)

    def step(self, optimizer, own_step, closure=None, cap_bytes=25 << 20):
        """The optimizer's step on this rank's share, round by round, each round's
        parameters broadcast by their stepping rank while the next round is stepped
        (at most two rounds in flight); returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = optimizer.param_groups
        saved = [g["params"] for g in groups]
        # Note [Sharded tp slices]: the unsliced parameters go over the dp group, then
        # the slices over the rdp group (every rank issues both in this order).
        parts = [(self._whole, self.dp_rank, get_dp_process_group())]
        if any(self._slices.by_rank):
            parts.append((self._slices, self.rdp_rank, get_rdp_process_group()))
        exchanges = []
        whole_step = getattr(optimizer, "_smp_whole_step", contextlib.nullcontext)
        try:
            with whole_step():  # Note [Steps in rounds]
                for division, me, group in parts:
                    exchanges.append(_C.ShareExchange(group, cap_bytes / 2**20,
                                                      state.cfg.timeout_s))
                    self._rounds_of(division.rounds(cap_bytes), me, groups, saved, own_step,
                                    exchanges[-1])
            for exchange in exchanges:
                exchange.wait(0)
        finally:
            del exchanges  # waits for anything still in flight (after an error)
        return loss

    def _rounds_of(self, rounds, me, groups, saved, own_step, exchange):
        """Steps each round's part of this rank's (group rank `me`) share and starts its
        exchange."""
        for per_rank in rounds:
            now = {id(p) for p in per_rank[me]}
            if now:
                try:
                    for g, ps in zip(groups, saved):
                        g["params"] = [p for p in ps if id(p) in now]
                    own_step()
                finally:
                    for g, ps in zip(groups, saved):
                        g["params"] = ps
            for r, ps in enumerate(per_rank):
                if ps:
                    exchange.start(ps, r)
            exchange.end_round()
            exchange.wait(2)  # the round before the last is in place


def enabled():
    return bool(getattr(state.cfg, "shard_optimizer_state", False)) and \
        ranks.dp_size() > 1


def shards():
    """Over how many ranks each pp rank's optimizer state is divided (1: not sharded)."""
    return ranks.dp_size() if enabled() else 1


def of(optimizer):
    """The optimizer's Shard, or None when it is not sharded."""
    return getattr(optimizer, "_smp_shard", None)


def divide(model):
    """The division of `model`'s parameters (partitioned) between its dp group; None
    when not sharding. Tied parameters' gradients stay on every rank."""
    if not enabled():
        return None
    params = model.replica.params()
    tied = model.pipeline.tied if model.pipeline is not None else None
    replicated = [p for p in params if tied is not None and tied.holds(p)]
    if ranks.tp_size() == 1:  # the rdp group is the dp group: nothing is a slice
        return Shard(params, ranks.dp_size(), ranks.dp_rank(), replicated)
    # Note [Sharded tp slices]
    sliced = [p for p in params if hasattr(p, "_smp_tp_dim")]  # as smp/replica.py marks
    rdp_of = [state.topology.rdp_rank(r) for r in ranks.get_dp_group()]
    return Shard(params, ranks.dp_size(), ranks.dp_rank(), replicated, sliced, rdp_of)


def install(model, optimizer):
    """Restricts `optimizer` to this rank's share of `model`'s parameters (once both
    exist and the model is partitioned)."""
    if optimizer is None or model is None or not model.partitioned or not enabled():
        return
    if of(optimizer) is not None:
        return
    if type(optimizer).__name__ in _COUPLED:
        raise _C.ConfigError(
            f"smp: config 'shard_optimizer_state'=true cannot shard {type(optimizer).__name__}, "
            "whose step couples every parameter; use an optimizer that updates each "
            "parameter from its own gradient (SGD, Adam, AdamW, ...) or set it to false")
    optimizer._smp_shard = model.replica.shard
    optimizer._smp_shard.restrict(optimizer)


def step(optimizer, own_step, args, kwargs):
    """The optimizer's step (`own_step`, its own method): sharded, or as it is."""
    shard = of(optimizer)
    if shard is None:
        return own_step(*args, **kwargs)
    closure = kwargs.pop("closure", args[0] if args else None)
    cap = int(getattr(state.model, "bucket_cap_mb", 25) * 2**20)
    return shard.step(optimizer, own_step, closure, max(cap, 1))
