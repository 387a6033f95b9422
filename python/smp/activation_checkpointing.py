"""Activation checkpointing (SMP v1.6+'s `smp.set_activation_checkpointing`).

A checkpointed module keeps only its inputs during the forward; its owner recomputes
its forward when the backward reaches it (torch's non-reentrant
`torch.utils.checkpoint`, run on whichever rank owns the module: the driver for its own
modules, the serving rank inside a served call, Note [Served backward] included).

Note [Checkpointed modules keep their random numbers]
With `preserve_rng_state` (the default) the recomputation draws the random numbers the
forward drew: checkpoint saves the default generator's state at the forward and
replays from it. Inside a pipelined step that generator holds the microbatch's own
stream (Note [Microbatch random streams] in smp_core/task_rng.h), so a Dropout inside a
checkpointed module gets the same mask in the recomputation, whatever ran in between,
and training equals training without checkpointing bit for bit
(tests/python/test_activation_checkpointing.py).

Where it applies:
- Any module: its forward runs under checkpoint on its owner (its hooks run once, at
  the call, not again in the recomputation).
- An `nn.Sequential`: its children in groups, by `strategy`: "each" (every child
  alone), "group_<n>" (n consecutive children at a time) or "contiguous" (every run of
  children on one rank as one group). A group never spans pp ranks: a run of children
  owned by another rank is checkpointed by that rank, as one group under "contiguous"
  or in groups of n (Note [Sequential segments] in placement.py), and a lone child
  routed elsewhere is checkpointed there on its own.
- Only while grad is enabled and outside the trace.
"""
import copy
import re
import weakref

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from smp import placement
from smp.process_state import is_tracing, state

__all__ = ["set_activation_checkpointing"]

_STRATEGY = re.compile(r"each|contiguous|group_([1-9][0-9]*)")
_configs = weakref.WeakKeyDictionary()  # module -> _Config (a module gone, its entry too)


class _Config:
    def __init__(self, preserve_rng_state, pack_args_as_tuple, strategy):
        self.preserve_rng_state = preserve_rng_state
        self.pack_args_as_tuple = pack_args_as_tuple
        self.strategy = strategy

    def group_size(self):
        """Children per group; None: a whole run ("contiguous")."""
        if self.strategy == "contiguous":
            return None
        m = _STRATEGY.fullmatch(self.strategy)
        return int(m.group(1)) if m.group(1) else 1


def set_activation_checkpointing(module, preserve_rng_state=True, pack_args_as_tuple=False,
                                 strategy="each"):
    """Checkpoints `module`'s activations: its owner keeps its inputs only and recomputes
    its forward during the backward. Call it after `smp.DistributedModel(...)`, on a
    module of the wrapped model (`model.get_module()....`), before or after the first
    step. `strategy` applies to an `nn.Sequential` ("each", "group_<n>", "contiguous");
    `pack_args_as_tuple` is accepted for SMP's scripts (a tuple passed between the
    children of a Sequential is checkpointed as it is)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"smp.set_activation_checkpointing: 'module' must be an "
                        f"nn.Module, got {type(module).__name__}")
    if not isinstance(strategy, str) or not _STRATEGY.fullmatch(strategy):
        raise ValueError(f"smp.set_activation_checkpointing: 'strategy'={strategy!r} is not "
                         "one of {each, group_<n> (n >= 1), contiguous}")
    for name, value in (("preserve_rng_state", preserve_rng_state),
                        ("pack_args_as_tuple", pack_args_as_tuple)):
        if not isinstance(value, bool):
            raise ValueError(f"smp.set_activation_checkpointing: '{name}'={value!r} is not "
                             "one of {True, False}")
    model = state.model
    if model is None:
        raise RuntimeError("smp.set_activation_checkpointing: no smp.DistributedModel yet; "
                           "wrap the model first and pass one of its modules "
                           "(model.get_module()...)")
    if not any(m is module for m in model.get_module().modules()):
        raise ValueError(f"smp.set_activation_checkpointing: the {type(module).__name__} "
                         "given is not a module of the smp.DistributedModel")
    _mark(module, _Config(preserve_rng_state, pack_args_as_tuple, strategy))
    if model.partitioned:
        _place(module)


def _mark(module, cfg):
    _configs[module] = cfg
    if isinstance(module, nn.Sequential):
        module.forward = _SequentialForward(module, cfg)
    else:
        module.forward = _CheckpointedForward(module, cfg)


def _active():
    return torch.is_grad_enabled() and not is_tracing()


def _checkpointed(fn, cfg, *args, **kwargs):
    return checkpoint(_replayable(fn, args, kwargs), *args, use_reentrant=False,
                      preserve_rng_state=cfg.preserve_rng_state, **kwargs)


# Note [Recomputing with the state the forward saw]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The recomputation calls the module's forward again with the same arguments. An
# argument that the forward changes in place is not the same the second time: Hugging
# Face's key/value cache (GPT-2's default, use_cache=True) has the layer's keys
# appended by the forward, so the recomputation attends over twice the tokens and its
# shapes differ from the saved ones. Hugging Face turns the cache off in the layers it
# checkpoints, which changes what the model returns. Here, before the forward, each
# argument that is neither a tensor nor an immutable value is copied with its tensors
# shared (a copy of the containers only: no tensor memory); the forward gets the
# originals, so what it changes is what the caller sees, as without checkpointing, and
# each recomputation gets a fresh copy of the saved state, so it computes what the
# forward computed. An argument that cannot be copied is passed as it is.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
              torch.Size, type(Ellipsis), slice, range)


def _stateful(value):
    """Whether the forward could change `value` in place: an object other than a
    tensor, a module or an immutable value, alone or inside tuples, lists and dicts."""
    if isinstance(value, (torch.Tensor, nn.Module) + _IMMUTABLE):
        return False
    if isinstance(value, (tuple, list)):
        return any(_stateful(v) for v in value)
    if isinstance(value, dict):
        return any(_stateful(v) for v in value.values())
    return True


def _tensors_in(value, found, seen):
    """Every tensor and module reachable from `value` through containers and object
    attributes (what a copy shares)."""
    if id(value) in seen or isinstance(value, _IMMUTABLE):
        return
    seen.add(id(value))
    if isinstance(value, (torch.Tensor, nn.Module)):
        found[id(value)] = value
        return
    if isinstance(value, dict):
        children = list(value.keys()) + list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = list(value)
    else:
        children = list(getattr(value, "__dict__", {}).values())
        for cls in type(value).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if isinstance(slot, str) and hasattr(value, slot):
                    children.append(getattr(value, slot))
    for child in children:
        _tensors_in(child, found, seen)


def _containers_copy(value):
    """`value` deep-copied except its tensors and modules, which the copy shares."""
    memo = {}
    _tensors_in(value, memo, set())
    return copy.deepcopy(value, memo)


def _replayable(fn, args, kwargs):
    """`fn`, whose second and later calls (recomputations) get a fresh copy of the
    stateful arguments as they were before the first (Note [Recomputing with the state
    the forward saw])."""
    where = [("a", i) for i, a in enumerate(args) if _stateful(a)] + \
        [("k", k) for k, v in kwargs.items() if _stateful(v)]
    if not where:
        return fn
    try:
        saved = _containers_copy([args[i] if kind == "a" else kwargs[i] for kind, i in where])
    except Exception:  # noqa: BLE001  (an argument deepcopy cannot copy: passed as it is)
        return fn
    calls = [0]

    def run(*a, **k):
        calls[0] += 1
        if calls[0] > 1:
            a, k = list(a), dict(k)
            for (kind, i), v in zip(where, _containers_copy(saved)):
                if kind == "a":
                    a[i] = v
                else:
                    k[i] = v
        return fn(*a, **k)
    return run


class _CheckpointedForward:
    """A module's forward, run under checkpoint (the instance attribute `forward`;
    deepcopy and pickle follow the module)."""

    def __init__(self, module, cfg):
        self.module, self.cfg = module, cfg
        self.inner = type(module).forward  # the class's own (after smp's routing)

    def __call__(self, *args, **kwargs):
        if not _active():
            return self.inner(self.module, *args, **kwargs)
        return _checkpointed(self.inner, self.cfg, self.module, *args, **kwargs)


def _chain(modules, x):
    for m in modules:
        x = m(x)
    return x


class _SequentialForward:
    """An nn.Sequential's forward, its children in checkpointed groups that never span
    pp ranks (a child or run owned elsewhere is a step of its own: its owner
    checkpoints it)."""

    def __init__(self, module, cfg):
        self.module, self.cfg = module, cfg

    def __call__(self, x):
        steps = placement.sequential_steps(self.module)
        if not _active():
            return _chain([step for _, step in steps], x)
        size = self.cfg.group_size()
        group = []

        def flush(x):
            if group:
                x = _checkpointed(_chain, self.cfg, list(group), x)
                group.clear()
            return x
        for kind, value in steps:
            if kind != "local":
                x = value(flush(x))
                continue
            group.append(value)
            if size is not None and len(group) == size:
                x = flush(x)
        return flush(x)


def after_partition(model):
    """Every rank, once the model is partitioned (DistributedModel._partition)."""
    for module in list(model.get_module().modules()):
        if module in _configs:
            _place(module)


def _place(module):
    """What partitioning changed for a checkpointed Sequential whose forward runs on
    another rank: the runs of its children this rank serves (Note [Sequential segments])
    are checkpointed here with its strategy, and so is each lone child served here."""
    cfg = _configs[module]
    if not isinstance(module, nn.Sequential):
        return
    segments = placement.served_segments(module)
    in_segment = {id(c) for seq in segments for c in seq}
    for seq in segments:
        _mark(seq, cfg)
    if not placement.is_routed(module):
        return  # its forward runs here: _SequentialForward groups its local children
    for child in module.children():
        if id(child) not in in_segment and not placement.is_routed(child):
            _mark(child, cfg)
