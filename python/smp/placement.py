"""Applying a partition plan to the user's module, in place.

The module tree stays the user's: every module keeps its class, attributes,
parameters, buffers and hooks, on every rank. What changes is where a module runs:

- Calling a module that another pp rank owns sends the call to its owner. The
  module's class is swapped for a subclass of it whose `__call__` routes the call
  (Note [Routing by class]); `isinstance`, attribute access and `repr` keep working.
- A plain `nn.Sequential` run of consecutive children owned by one other rank goes
  as one remote call (Note [Sequential segments]).
- A parameter (or buffer) is kept on every rank that owns a module holding it
  directly, and its storage is released elsewhere. A parameter held on several pp
  ranks is *tied* (an output projection sharing the embedding's weight): its copies
  start equal (`TiedParameters.sync_values`) and its gradient is summed across its
  holders after every step (Note [Tied gradient sum], smp_core/tied_grads.cpp).
- The train/eval mode of a module's whole subtree travels with every remote call,
  so the owner runs it in the mode the caller has (Note [Mode travels with the call]);
  so does the caller's torch.autocast state, in the request's header (Note [Autocast
  travels] in smp_core/autocast_state.h).
"""
import torch
import torch.distributed as dist
import torch.optim.optimizer as optim_module

import smp._C as _C
from smp import groups
from smp.process_state import state
from smp.ranks import get_pp_group, pp_size, rank

__all__ = []

# id(module) -> (engine, name, owner): modules whose calls go to another rank.
_routes = {}
# id(nn.Sequential) -> list of (kind, value): "local" module or "remote" (name, owner).
_segments = {}
# id(nn.Sequential) -> the Sequentials of its runs this rank serves (Note [Sequential
# segments]).
_served = {}
_remote_classes = {}
_segmented_classes = {}


# Note [Calls are not compiled]: a call routed to another rank is communication,
# which Dynamo cannot trace (it would warn about `_pickle.dumps` and break the graph on
# every message it meets). Under torch.compile (of the module before wrapping, or of
# the wrapper) the route is a function Dynamo is told to skip: the graph ends before
# the call and the next starts after it, quietly, and the call runs as without compile.
def _skipped_by_compile(fn):
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:
        return fn
    try:
        return disable(fn, reason="smp: a module call routed to another pipeline rank")
    except TypeError:  # (torch < 2.8: no reason)
        return disable(fn)


@_skipped_by_compile
def _send(engine, name, owner, args, kwargs):
    return engine.call(name, owner, args, kwargs)


# Note [Routing by class]: a module owned by another rank must not run here, yet it
# must stay in its parent (users reach `model.module.head.weight`, optimizers hold its
# Parameters, `state_dict()` lists it). Swapping its class for a subclass whose
# `__call__` sends the call keeps every attribute and `isinstance`, and skips this
# rank's copy of its hooks (they run on the owner, where the module really runs). A
# copy of the module (deepcopy) is not in the route table and runs as usual.
def _remote_call(self, *args, **kwargs):
    route = _routes.get(id(self))
    if route is None:
        return type(self).__mro__[1].__call__(self, *args, **kwargs)
    engine, name, owner = route
    return _send(engine, name, owner, args, kwargs)  # Note [Calls are not compiled]


def _remote_class(cls):
    sub = _remote_classes.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__call__": _remote_call, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__,
                                           "_smp_remote": True})
        _remote_classes[cls] = sub
    return sub


def _segmented_forward(self, x):
    for _, step in sequential_steps(self):
        x = step(x)
    return x


def _segmented_class(cls):
    sub = _segmented_classes.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"forward": _segmented_forward,
                                           "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__})
        _segmented_classes[cls] = sub
    return sub


def _swap_class(module, make):
    base = type(module)
    if getattr(base, "_smp_remote", False) or base in _segmented_classes.values():
        return  # already routed (a module reachable under two names)
    module.__class__ = make(base)


def is_routed(module):
    """Whether `module`'s calls go to another rank (Note [Routing by class])."""
    return id(module) in _routes


def sequential_steps(seq):
    """How the nn.Sequential `seq` runs on this rank, in order: ("local", child) for a
    child run here, ("remote", fn) for a child or a run of children that another rank
    serves (Note [Sequential segments]); fn takes and returns the activation."""
    steps = []
    for kind, value in _segments.get(id(seq), [("local", c) for c in seq]):
        if kind == "local":
            steps.append(("remote" if is_routed(value) else "local", value))
        else:
            engine, name, owner = value
            steps.append(("remote", lambda x, e=engine, n=name, o=owner: _send(e, n, o, (x,), {})))
    return steps


def served_segments(seq):
    """The Sequentials of runs of `seq`'s children that this rank serves."""
    return list(_served.get(id(seq), []))


def restore_classes(table):
    """Undoes the class swaps (tests, re-initialisation)."""
    for _, m in table:
        _routes.pop(id(m), None)
        _segments.pop(id(m), None)
        _served.pop(id(m), None)
        base = type(m)
        if getattr(base, "_smp_remote", False) or base in _segmented_classes.values():
            m.__class__ = base.__mro__[1]


def subtrees(table):
    """name -> the modules at that name and below, in table order. The table is in
    pre-order, so each subtree is a contiguous run: one pass finds where each ends."""
    names = [n for n, _ in table]
    end = [len(table)] * len(table)
    open_ = []  # indices of the ancestors of the current entry
    for i, n in enumerate(names):
        while open_ and not (names[open_[-1]] == "" or n.startswith(names[open_[-1]] + ".")):
            end[open_.pop()] = i
        open_.append(i)
    mods = [m for _, m in table]
    return {names[i]: mods[i:end[i]] for i in range(len(table))}


# Note [Mode travels with the call]: `model.train()`/`eval()` (or a user's
# `model.module.encoder.dropout.eval()`) sets flags on this rank's copies of the
# modules. Each remote call carries the flags of the called module's subtree (one
# byte per module), and the owner sets them on its copies before running it, so the
# mode in force where the call is made is the mode the owner runs with, per call.
def mode_flags(modules):
    return bytes(m.training for m in modules)


def apply_mode_flags(modules, flags):
    if mode_flags(modules) == flags:  # the usual case: nothing switched since last call
        return
    for m, f in zip(modules, flags):
        m.training = bool(f)


class TiedCopiesError(RuntimeError):
    """The copies of a parameter tied across pp ranks differ (Note [Tied copies])."""


class _OptimizerSteps:
    """Counts the optimizer steps applied to this rank's tied parameters: torch's
    global step post-hook (torch >= 2.0), registered once the model has tied ones."""

    def __init__(self):
        self.steps = 0
        self.tied = []      # the tied tensors of this rank
        self.holds = {}     # id(optimizer) -> whether it updates one of them
        self.handle = None

    def count(self, tied):
        """This rank's step count, or -1 where torch has no step hooks."""
        hook = getattr(optim_module, "register_optimizer_step_post_hook", None)
        if hook is None:
            return -1
        if self.handle is None:
            self.handle = hook(self._stepped)
        if len(tied) != len(self.tied) or any(a is not b for a, b in zip(tied, self.tied)):
            self.tied, self.holds = list(tied), {}
        return self.steps

    def _stepped(self, optimizer, *_):
        holds = self.holds.get(id(optimizer))
        if holds is None:
            ids = {id(t) for t in self.tied}
            holds = self.holds[id(optimizer)] = any(
                id(p) in ids for g in optimizer.param_groups for p in g["params"])
        if holds:
            self.steps += 1


_steps = _OptimizerSteps()


def _copies_differ(name, holders, steps):
    """TiedCopiesError's text: what differs between the holders of tied parameter
    `name`, from each holder's count of optimizer steps (-1: not known)."""
    head = f"smp: the copies of tied parameter '{name}' on pp ranks {holders} differ"
    tail = f" (rank {rank()})"
    clip = ("torch.nn.utils.clip_grad_norm_ on some of the model's parameters clips each "
            "rank's gradients by that rank's own norm; model.clip_grad_norm_(max_norm) "
            "(or smp.clip_grad_norm_(model, max_norm)) clips by the norm over every "
            "partition and keeps tied copies equal")
    counts = set(steps.values())
    if -1 in counts:
        return (f"{head}: something changed the gradient or the value of one copy only "
                f"since the last step. One known cause: {clip}{tail}")
    if len(counts) > 1:
        most = max(counts)
        behind = [h for h in holders if steps[h] < most]
        ahead = [h for h in holders if steps[h] == most]
        return (f"{head}: pp rank{'s' if len(ahead) > 1 else ''} "
                f"{', '.join(map(str, ahead))} applied {most} optimizer steps to it and "
                + ", ".join(f"pp rank {h} {steps[h]}" for h in behind) +
                ": an optimizer step was skipped or taken on some pipeline ranks only. A "
                "loss scaler that decides per rank does that: torch.amp.GradScaler (or "
                "torch.cuda.amp.GradScaler) skips the step on a rank whose own gradients "
                "hold an inf or nan, while the other stages step. Use one decision for "
                "every stage, or call optimizer.step() on every rank" + tail)
    return (f"{head}: every holder applied the same {counts.pop()} optimizer steps to it, "
            "so the gradient or the value of one copy was changed outside the optimizer's "
            f"step since the last step. One known cause: {clip}{tail}")


class TiedParameters:
    """Parameters and buffers held on more than one pp rank, and how to keep them equal.

    `entries`: (name, tensor, holders) in the plain module's order; `holders` are the pp
    ranks owning a module that holds the tensor directly. Every pp rank builds the same
    list (the plan and the module tree are the same on every rank), so the collectives
    below are issued in the same order everywhere.
    """

    def __init__(self, entries, me):
        self.entries = entries
        self.me = me
        self._native = None  # begin_step(): this step's _C.TiedGradients
        self._groups = {}  # connect(): Note [Tied holders' groups]

    def connect(self):
        """Makes the holders' process groups (collective over the world: every rank,
        in the same order, when the plan is applied)."""
        self._groups = _holder_groups(self.entries)

    def holds(self, tensor):
        """Whether `tensor` is one of the tied tensors."""
        return any(t is tensor for _, t, _ in self.entries)

    def is_counted_here(self, tensor):
        """Whether this rank counts `tensor` in global reductions (norms): its lowest
        holder does, so a tied parameter counts once."""
        for _, t, holders in self.entries:
            if t is tensor:
                return holders[0] == self.me
        return True

    def sync_values(self):
        """Copies each tied tensor from its lowest holder to the others (after
        partitioning and after loading state), so the copies start equal."""
        with torch.no_grad():
            for _, t, holders in self.entries:
                if self.me in holders:
                    src = get_pp_group()[holders[0]]
                    dist.broadcast(t.detach(), src=src, group=self._groups[tuple(holders)])

    def check_copies(self):
        """Raises on every pp rank if the copies of a tied parameter differ.

        Note [Tied copies]: sum_grads leaves every holder the same gradient, so equal
        optimizers keep the copies bitwise equal; a step that changes a copy's gradient
        on one holder only (torch.nn.utils.clip_grad_norm_ on some of the model's
        parameters clips by that rank's own norm; on all of them it is smp's global clip,
        Note [torch's clip on the whole model]) would make them drift apart silently. Each step starts by
        comparing an XXH3 fingerprint of every copy: one pass over the tied tensors
        (~7 GB/s) and one all_gather of 8 bytes per tied parameter on the pp group.
        The gather also carries each rank's count of optimizer steps applied to its
        tied parameters, so the error says what differs: a step one holder skipped (a
        per-rank loss scaler), or a change made outside the optimizer (a per-rank clip).
        """
        params = [(name, t, holders) for name, t, holders in self.entries
                  if isinstance(t, torch.nn.Parameter)]
        if not params:
            return
        mine = [t for _, t, holders in params if self.me in holders]
        prints = iter(_C.fingerprints([t.detach() for t in mine]))
        # The last entry: how many optimizer steps this rank applied to its tied
        # parameters (-1: not known), to say what differs when copies do.
        local = torch.tensor([next(prints) if self.me in holders else 0
                              for _, _, holders in params] + [_steps.count(mine)],
                             dtype=torch.int64)
        everyone = [torch.empty_like(local) for _ in range(pp_size())]
        dist.all_gather(everyone, local, group=groups.get_pp_process_group())
        for i, (name, _, holders) in enumerate(params):
            values = {int(everyone[h][i]) for h in holders}
            if len(values) > 1:
                steps = {h: int(everyone[h][-1]) for h in holders}
                raise TiedCopiesError(_copies_differ(name, holders, steps))

    def begin_step(self):
        """Sets each held tied parameter's gradient aside, so the step's backward
        leaves only this step's contribution in .grad; returns the C++ object that
        sums them as the step ends (Note [Tied gradient sum] in smp_core/tied_grads.cpp,
        run by the dispatcher: Note [Step's finish]), or restores them; None when this
        rank holds no tied parameter. Made each step, from the parameters' current
        tensors (a deferred model's are swapped in after the plan is applied)."""
        held = [(name, t, self._groups[tuple(holders)]) for name, t, holders in self.entries
                if self.me in holders and isinstance(t, torch.nn.Parameter)]
        self._native = _C.TiedGradients(held, float(state.cfg.timeout_s)) if held else None
        if self._native is not None:
            self._native.begin_step()
        return self._native

    def restore_grads(self):
        """Puts back exactly what begin_step set aside (a step without backward, or a
        failed one, whose un-summed contribution would make the copies differ)."""
        if self._native is not None:
            self._native.restore()

    def sum_grads(self):
        """After the step's backward on every pp rank: each tied parameter's gradient
        becomes (what it held before the step) + (the sum over its holders of this
        step's contribution). The dispatcher does this itself at a pipelined step's
        end; this is the same, called directly."""
        if self._native is not None:
            self._native.sum()


# Note [Tied holders' groups]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A tied tensor's gradient sum and value copy involve its holders only. They run on a
# process group of those pp ranks (one per holder set and model replica, made by every
# rank in the same order when the plan is applied), so a rank that does not hold the
# tensor allocates nothing for it: before, every pp rank joined a pp-group allreduce of
# a zero buffer the tensor's size (131 MB per step for a 32000 x 1024 tied embedding,
# on every rank), and holders copied their gradient into a flat buffer first.
def _holder_groups(entries):
    return {holders: groups.new_groups_within_pp_groups(holders)
            for holders in sorted({tuple(h) for _, _, h in entries})}


def find_tied(table, owner_of, me):
    """Tensors held directly by modules of more than one pp rank."""
    holders, first_name, tensors = {}, {}, {}
    for name, m in table:
        for tname, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is None:
                continue
            holders.setdefault(id(t), set()).add(owner_of[name])
            first_name.setdefault(id(t), f"{name}.{tname}" if name else tname)
            tensors[id(t)] = t
    entries = [(first_name[k], tensors[k], sorted(h)) for k, h in holders.items() if len(h) > 1]
    return TiedParameters(entries, me), holders


def _is_plain_sequential(module):
    return type(module).forward is torch.nn.Sequential.forward


def _sequential_runs(parent, by_id, owner_of):
    """Maximal runs of consecutive children with one owner: [(owner, [children])]."""
    runs = []
    for c in parent._modules.values():
        if c is None:
            continue
        o = owner_of[by_id[id(c)]]
        if runs and runs[-1][0] == o:
            runs[-1][1].append(c)
        else:
            runs.append((o, [c]))
    return runs


def apply(table, owner_of, engine, me):
    """Applies the plan to the module tree in place; fills `engine.owned` and
    `engine.subtrees`. Returns the TiedParameters.

    Args:
        table: (name, module) of every unique module in pre-order.
        owner_of: module name -> pp rank.
        engine: the pipeline Engine of this rank.
        me: this rank's pp rank.
    """
    by_id = {id(m): name for name, m in table}
    sequentials = [(n, m) for n, m in table if _is_plain_sequential(m)]
    engine.subtrees.update(subtrees(table))
    for name, m in table:
        if owner_of[name] == me:
            engine.owned[name] = m
        else:
            _routes[id(m)] = (engine, name, owner_of[name])
            _swap_class(m, _remote_class)
    for pname, parent in sequentials:
        _segment_sequential(pname, parent, by_id, owner_of, engine, me)
    tied, holders = find_tied(table, owner_of, me)
    tied.connect()
    # Release what only other ranks hold: that is the point of model parallelism. The
    # Parameter objects stay (an optimizer may hold them); their storage goes.
    with torch.no_grad():
        for _, m in table:
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if t is not None and me not in holders[id(t)] and t.numel() > 0:
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                    t.grad = None
    return tied


# Note [Sequential segments]: a plain nn.Sequential calls its children one after the
# other, so a run of consecutive children owned by one other rank is sent as ONE
# remote call of the whole run (one round trip per microbatch instead of one per
# child). The Sequential's owner runs it through a plan of local children and remote
# segments; the run's owner serves the segment as an nn.Sequential of the run; each
# child alone still routes itself when called directly elsewhere.
def _segment_sequential(pname, parent, by_id, owner_of, engine, me):
    plan, coalesced = [], False
    for o, run in _sequential_runs(parent, by_id, owner_of):
        if o == owner_of[pname] or len(run) == 1:
            plan.extend(("local", c) for c in run)
            continue
        names = [by_id[id(c)] for c in run]
        seg = f"{names[0]}..{names[-1]}"
        engine.subtrees[seg] = [m for n in names for m in engine.subtrees[n]]
        if o == me:
            engine.owned[seg] = torch.nn.Sequential(*run)
            _served.setdefault(id(parent), []).append(engine.owned[seg])
        plan.append(("remote", (engine, seg, o)))
        coalesced = True
    if coalesced and owner_of[pname] == me:
        _segments[id(parent)] = plan
        _swap_class(parent, _segmented_class)
