"""`smp.partition(index)`: manual placement of modules created inside the context.

Modules record the innermost active index when they are constructed (torch.nn.Module
__init__ is wrapped once, on import of smp; outside any context it costs one check).
The partitioner honours these placements when `auto_partition` is False and ignores
them otherwise (SMP v1 semantics); unplaced modules go to `default_partition`.
"""
import contextlib
import functools

import torch

__all__ = []

_stack = []


def _install_module_hook():
    init = torch.nn.Module.__init__
    if getattr(init, "_smp_wrapped", False):
        return

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if _stack:
            object.__setattr__(self, "_smp_partition", _stack[-1])
    wrapped._smp_wrapped = True
    torch.nn.Module.__init__ = wrapped


_install_module_hook()


@contextlib.contextmanager
def partition(index):
    """Places modules created inside on partition `index`; the innermost wins.

    Raises:
        ValueError: `index` is not a non-negative integer.
    """
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"smp.partition: index={index!r} is not an integer >= 0")
    _stack.append(index)
    try:
        yield
    finally:
        _stack.pop()


def set_partition(module, index):
    """SMP's `smp.set_partition(module, index)`: places `module` (and what it contains
    that has no placement of its own) on partition `index`, like creating it inside
    `smp.partition(index)`. Call it before the first step partitions the model (after
    `smp.DistributedModel(...)` is fine, on `model.get_module()`'s modules); it is
    honoured when `auto_partition` is False.

    Raises:
        TypeError: `module` is not an nn.Module.
        ValueError: `index` is not an integer >= 0.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"smp.set_partition: module must be an nn.Module, got "
                        f"{type(module).__name__}")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"smp.set_partition: index={index!r} is not an integer >= 0")
    object.__setattr__(module, "_smp_partition", index)


def manual_partition_of(module):
    """The partition a module was created under, or -1."""
    return getattr(module, "_smp_partition", -1)
