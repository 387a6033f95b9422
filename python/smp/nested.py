"""The one walker over nested containers (lists, tuples, namedtuples, dicts) that smp
uses wherever it looks inside a module's arguments or outputs: packing a remote call
(`flatten`/`unflatten`), measuring output bytes while tracing (`leaves`), and
rebuilding per-microbatch containers (`same_sequence`).
"""
import torch

__all__ = []


def same_sequence(template, items):
    """A list/tuple of `template`'s type (namedtuples too) holding `items`."""
    return type(template)(*items) if hasattr(template, "_fields") else type(template)(items)


def _walk(value, fn, is_leaf, rebuild):
    if is_leaf(value):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [_walk(v, fn, is_leaf, rebuild) for v in value]
        return same_sequence(value, items) if rebuild else None
    if isinstance(value, dict):
        items = [(k, _walk(v, fn, is_leaf, rebuild)) for k, v in value.items()]
        return type(value)(items) if rebuild else None
    return value


def map_leaves(value, fn, is_leaf):
    """`value` with every leaf (is_leaf(x) true) replaced by fn(leaf); containers keep
    their types; anything else is kept as it is."""
    return _walk(value, fn, is_leaf, True)


def leaves(value, is_leaf):
    """The leaves of `value`, in the order map_leaves visits them (nothing is rebuilt)."""
    found = []
    _walk(value, found.append, is_leaf, False)
    return found


class TensorSlot:
    """Stands for the tensor at `index` in a flattened structure (pickles small)."""

    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index

    def __reduce__(self):
        return (TensorSlot, (self.index,))


def _is_tensor(x):
    return isinstance(x, torch.Tensor)


def flatten(value, tensors):
    """Replaces tensors in `value` by slots appended to `tensors`; returns the skeleton.

    A tensor that appears several times (the same object: `attn(h, h, h)`) is appended
    once and every appearance gets its slot, so unflatten gives back one object where
    there was one: a module may test `query is key`, or change an argument in place.
    """
    slots = {}

    def slot(t):
        s = slots.get(id(t))
        if s is None:
            tensors.append(t)
            s = slots[id(t)] = TensorSlot(len(tensors) - 1)
        return s
    return map_leaves(value, slot, _is_tensor)


def unflatten(skeleton, tensors):
    """The inverse of flatten."""
    return map_leaves(skeleton, lambda s: tensors[s.index], lambda x: isinstance(x, TensorSlot))


def tensor_leaves(value):
    return leaves(value, _is_tensor)
