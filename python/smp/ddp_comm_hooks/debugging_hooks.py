"""Debugging hooks: `noop_hook` returns the bucket unreduced (for measuring the cost of
communication; training with it does not synchronise replicas)."""
from smp import _C

__all__ = ["noop_hook"]

noop_hook = _C.noop_hook
