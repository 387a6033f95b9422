"""Agreement between ranks: every rank raises the same error, or none does.

`agree` is the one implementation of "raise the same error on every rank": each rank
contributes its error (or None) to one allgather, and every rank computes the same
verdict from the same list. A rank that raised alone would leave its peers waiting in
their next collective until the timeout, or make Gloo abort them.

The first step uses it before the first collective that could abort or hang: a model
that differs between dp replicas makes Gloo abort the process in the first broadcast
(a size mismatch inside a collective); one that differs between pp ranks makes the
ranks disagree about who owns what. So the first step starts with one allgather over
the world of each rank's model signature (and of any error it already has, such as a
bad input), and every rank raises the same error, naming the tensor, the shapes and
the ranks.
"""
import hashlib
import random
import sys

import torch

from smp._C import ConfigError
from smp.collectives import allgather
from smp.groups import CommGroup
from smp.process_state import is_initialized
from smp.ranks import members

__all__ = []


class ModelMismatchError(RuntimeError):
    """The model differs between ranks (raised on every rank, with the same text)."""


def signature(module):
    """[(kind, name, shape, dtype)] of the module's modules, parameters and buffers."""
    sig = [("module", name, type(m).__name__, "") for name, m in module.named_modules()]
    sig += [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    sig += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    return sig


def _digest(sig):
    return hashlib.sha1(repr(sig).encode()).hexdigest()


def _ranks_text(ranks):
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def describe_mismatch(sigs):
    """The first difference between the ranks' signatures, as one sentence."""
    n = max(len(s) for s in sigs)
    for i in range(n):
        entries = [s[i] if i < len(s) else None for s in sigs]
        if all(e == entries[0] for e in entries):
            continue
        groups = {}
        for r, e in enumerate(entries):
            groups.setdefault(e, []).append(r)
        parts = []
        for e, ranks in groups.items():
            if e is None:
                parts.append(f"nothing on {_ranks_text(ranks)}")
            elif e[0] == "module":
                parts.append(f"module '{e[1]}' ({e[2]}) on {_ranks_text(ranks)}")
            else:
                parts.append(f"{e[0]} '{e[1]}' of shape {list(e[2])} and {e[3]} on "
                             f"{_ranks_text(ranks)}")
        counts = ", ".join(f"{sum(1 for x in s if x[0] == 'parameter')}" for s in sigs)
        return (f"smp: the model differs between ranks at entry {i}: " + "; ".join(parts) +
                f" (parameter counts by rank: [{counts}]). Every rank must build the same "
                "model before smp.DistributedModel")
    return "smp: the model differs between ranks"


def error_of(exc):
    """What a rank tells the others about its exception: (kind, text)."""
    return None if exc is None else (type(exc).__name__, str(exc))


def agree(error, group, verdict, value=None, own_first=False):
    """Raises an error on every rank of `group` if any rank has one; else returns every
    rank's `value`. Collective over `group`: every member must call it.

    One allgather of (value, error) over `group`; a group of one rank (or smp not
    initialized) gathers nothing. Every rank then derives its exception from the same
    list, so the text is the same everywhere (with own_first, except on a failing rank).

    Args:
        error: this rank's exception, or None.
        group: a CommGroup.
        verdict: callable(failures, size) -> the exception every rank raises, where
            `failures` is [(group rank, kind, text)] of each failing rank in group-rank
            order and `size` the number of ranks that took part.
        value: what else this rank contributes (picklable).
        own_first: a failing rank raises its own exception object (its traceback
            intact); only the ranks without an error raise the verdict.

    Returns:
        [value of each group rank], in group-rank order.

    Raises:
        The verdict's exception (or, with own_first, this rank's `error`) on every rank
        when any rank has an error.
    """
    mine = (value, error_of(error))
    if is_initialized() and len(members(group)) > 1:
        everyone = allgather(mine, group)
    else:
        everyone = [mine]
    failures = [(r, e[0], e[1]) for r, (_, e) in enumerate(everyone) if e is not None]
    if failures:
        if own_first and error is not None:
            raise error
        raise verdict(failures, len(everyone))
    return [v for v, _ in everyone]


def first_error(what):
    """The verdict of `agree` that raises the lowest failing rank's error, as a
    ConfigError (for a ValueError) or a RuntimeError, naming that rank and `what`."""
    def verdict(failures, size):
        r, kind, text = failures[0]
        cls = ConfigError if kind in ("ConfigError", "ValueError") else \
            MemoryError if kind == "MemoryError" else RuntimeError
        return cls(f"{text} (rank {r}, in {what}; raised on every rank)")
    return verdict


def agree_on_first_step(module, error=None):
    """World allgather of (signature digest, error); raises the same error on every rank.

    Args:
        module: the user's module (before partitioning).
        error: an exception this rank already has (a bad input), or None.

    Raises:
        ConfigError (for a ValueError) or RuntimeError carrying the first failing
        rank's message, or ModelMismatchError, on every rank.
    """
    sig = signature(module)
    digests = agree(error, CommGroup.WORLD, first_error("the first step"),
                    value=_digest(sig))
    if len(set(digests)) > 1:
        sigs = allgather(sig, CommGroup.WORLD)
        raise ModelMismatchError(describe_mismatch(sigs))


def snapshot_side_effects(module):
    """What a trace may change: buffers and RNG states. Returns a restore function."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    py_state = random.getstate()
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    np_random = None
    if "numpy" in sys.modules:
        np_random = sys.modules["numpy"].random.get_state()

    def restore():
        with torch.no_grad():
            for b, saved in buffers:
                if b.shape == saved.shape:
                    b.copy_(saved)
        random.setstate(py_state)
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)
        if np_random is not None:
            sys.modules["numpy"].random.set_state(np_random)
    return restore
