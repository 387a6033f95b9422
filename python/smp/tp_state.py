"""Tensor-parallel slices in state dicts and checkpoints (issue 41; docs/checkpoint.md,
"Tensor parallelism").

Note [Slices in checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A tp rank holds of a distributed parameter (`p._smp_tp_dim`) the contiguous slice
`p._smp_tp_slice = (start, length)` along `_smp_tp_dim` of `p._smp_tp_full_shape`;
Adam's `exp_avg` / `exp_avg_sq` and any other per-parameter optimizer tensor of the
parameter's shape are sliced alike. Under tp > 1:

- `model.local_state_dict()` and `optimizer.local_state_dict()` hold this tp rank's
  slices and every replicated tensor, and a table `_smp_tp` = {"rank": tp rank,
  "size": tp size, "slices": {name: (dim, full shape, start, length)}} naming the
  sliced entries (by parameter name). A partial save is one part per (pp rank, tp rank)
  of rdp rank 0 (part index pp_rank * tp_size + tp_rank), each complete for its tp rank:
  replicated tensors are in every tp rank's part, so a job of the same layout reads
  only its own part.
- Parts merge (smp/checkpoint/_parts.py) into one dict in which a sliced entry read from
  several tp parts is a `Slices`: the pieces as saved, unread until a rank keeps them.
  A rank of the same layout keeps its own piece as it is (bitwise); another layout cuts
  its slice from the concatenation (`Slices.cut`); a plain module takes `full()`.
- A full tensor where a slice is expected (a full checkpoint, a plain module's state
  dict) is cut at the rank's slice; `resolve` does both.
- Full state dicts (`model.state_dict()`, `optimizer.state_dict()`, full checkpoints)
  gather the slices over the tp group into full tensors, so they load into the plain
  (reference) module.
"""
import torch

__all__ = ["Slices"]

TP_KEY = "_smp_tp"


class Slices:
    """The tp slices of one tensor, as parts of a partial checkpoint hold them.

    Attributes:
        dim: the dim the tensor is cut along.
        full_shape: the whole tensor's shape.
        pieces: {start: tensor}, each a contiguous slice along `dim` starting at `start`.
    """

    __slots__ = ("dim", "full_shape", "pieces")

    def __init__(self, dim, full_shape, pieces=None):
        self.dim, self.full_shape = int(dim), tuple(full_shape)
        self.pieces = dict(pieces or {})

    @property
    def shape(self):
        return torch.Size(self.full_shape)

    def add(self, start, tensor):
        self.pieces.setdefault(int(start), tensor)

    def _ordered(self, name="tensor"):
        end, out = 0, []
        for start in sorted(self.pieces):
            t = self.pieces[start]
            if start != end:
                break
            out.append(t)
            end += t.shape[self.dim]
        if end != self.full_shape[self.dim]:
            have = sorted((s, s + t.shape[self.dim]) for s, t in self.pieces.items())
            raise RuntimeError(f"smp: the tp slices of '{name}' do not cover its full shape "
                               f"{list(self.full_shape)} along dim {self.dim} (have "
                               f"{have}): a part of the checkpoint is missing")
        return out

    def full(self, name="tensor"):
        """The whole tensor (the pieces concatenated)."""
        pieces = self._ordered(name)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def cut(self, start, length, name="tensor"):
        """The slice [start, start + length) along `dim`: a saved piece itself when one
        is exactly that slice, else cut from the whole."""
        t = self.pieces.get(start)
        if t is not None and t.shape[self.dim] == length:
            return t
        return self.full(name).narrow(self.dim, start, length).clone()

    def sources(self, start=None, length=None):
        """The pieces `cut(start, length)` (or `full()`, start None) reads."""
        if start is not None:
            t = self.pieces.get(start)
            if t is not None and t.shape[self.dim] == length:
                return [t]
        return list(self.pieces.values())

    def __reduce__(self):
        return (Slices, (self.dim, self.full_shape, self.pieces))

    def __repr__(self):
        spans = [(s, s + t.shape[self.dim]) for s, t in sorted(self.pieces.items())]
        return f"smp.tp_state.Slices(dim={self.dim}, full_shape={list(self.full_shape)}, " \
               f"pieces={spans})"


def mark_of(t):
    """(dim, full shape, start, length) of a tp-sliced tensor (a Parameter of a
    distributed module), else None."""
    dim = getattr(t, "_smp_tp_dim", None)
    if dim is None:
        return None
    full = tuple(getattr(t, "_smp_tp_full_shape", None) or t.shape)
    # (another pp rank's parameter is released: its own shape is gone)
    start, length = getattr(t, "_smp_tp_slice", None) or (0, full[dim])
    return (int(dim), full, int(start), int(length))


def local_shape(mark):
    dim, full, _, length = mark
    return tuple(length if i == dim else n for i, n in enumerate(full))


def is_cut(mark):
    """Whether `mark` is a proper slice (tp > 1), not the whole tensor."""
    return mark is not None and mark[3] != mark[1][mark[0]]


def table(marks, names, tp_rank, tp_size):
    """The `_smp_tp` entry of a local state dict whose sliced entries are `names`."""
    return {"rank": tp_rank, "size": tp_size,
            "slices": {n: marks[n] for n in names if is_cut(marks.get(n))}}


def _add(slices_by, key, mark, value):
    dim, full, start, length = mark
    s = slices_by.get(key)
    if s is None:
        s = slices_by[key] = Slices(dim, full)
    s.add(start, value)


def _is_piece(value, mark):
    return torch.is_tensor(value) and tuple(value.shape) == local_shape(mark)


def merge(objs, plain_merge):
    """Merges local state dicts of several tp (and pp) ranks, some carrying `_smp_tp`:
    each sliced entry becomes a `Slices` of the pieces the dicts hold (a model's
    entries by key; an optimizer's by-name state, per parameter, its tensors of the
    slice's shape); everything else merges by `plain_merge(list of dicts)`."""
    pieces, stripped = {}, []
    for o in objs:
        marks = (o.get(TP_KEY) or {}).get("slices", {})
        o = {k: v for k, v in o.items() if k != TP_KEY}
        state = o.get("state") if isinstance(o.get("state"), dict) and "param_groups" in o \
            else None
        if state is not None:  # an optimizer's by-name state
            state = dict(state)
            for name, mark in marks.items():
                st = state.get(name)
                if not isinstance(st, dict):
                    continue
                st = dict(st)
                for sk in list(st):
                    if _is_piece(st[sk], mark):
                        _add(pieces, ("state", name, sk), mark, st.pop(sk))
                state[name] = st
            o["state"] = state
        else:
            for name, mark in marks.items():
                if name in o and _is_piece(o[name], mark):
                    _add(pieces, (name,), mark, o.pop(name))
        stripped.append(o)
    out = plain_merge(stripped)
    # Back in their places, in the order of the first dict that held them.
    for key, s in pieces.items():
        if len(key) == 1:
            out[key[0]] = s
        else:
            out.setdefault("state", {}).setdefault(key[1], {})[key[2]] = s
    if pieces:
        _reorder(out, objs)
    return out


def _reorder(out, objs):
    """Restores the key order of the parts (the model's order) after merge put the
    sliced entries back last."""
    order = []
    seen = set()
    for o in objs:
        for k in o:
            if k != TP_KEY and k not in seen:
                seen.add(k)
                order.append(k)
    items = [(k, out[k]) for k in order if k in out] + \
        [(k, v) for k, v in out.items() if k not in seen]
    out.clear()
    out.update(items)


def has_table(objs):
    return any(isinstance(o, dict) and TP_KEY in o for o in objs)


def materialize(obj, name=""):
    """`obj` with every Slices made its full tensor (in nested dicts and lists)."""
    if isinstance(obj, Slices):
        return obj.full(name)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            if k != TP_KEY:
                out[k] = materialize(v, k if isinstance(k, str) else name)
        return out
    if isinstance(obj, list):
        return [materialize(v, name) for v in obj]
    return obj


def resolve(value, mark, name):
    """What a tensor of `mark` (None: a whole tensor) takes from a loaded `value`: a
    Slices cut at the rank's slice (its own piece when saved at this slice), or whole;
    a full tensor where a slice is expected cut at the slice; anything else as it is.

    Raises:
        RuntimeError: a Slices of another full shape, or whose pieces miss part.
    """
    if isinstance(value, Slices):
        if mark is None:
            return value.full(name)
        dim, full, start, length = mark
        if value.full_shape != full or value.dim != dim:
            raise RuntimeError(f"smp: load_state_dict: '{name}' is {list(value.full_shape)} "
                               f"cut along dim {value.dim} in the checkpoint, the model's "
                               f"{list(full)} cut along dim {dim}")
        return value.cut(start, length, name)
    if mark is not None and torch.is_tensor(value) and is_cut(mark) \
            and tuple(value.shape) == mark[1]:
        dim, _, start, length = mark
        return value.narrow(dim, start, length)
    return value


def sources(value, mark):
    """The tensors `resolve(value, mark, ...)` reads (to verify them first)."""
    if isinstance(value, Slices):
        return value.sources(*(mark[2:] if mark is not None else (None, None)))
    return [value]  # (whatever tensors it holds)


def resolve_state(state, mark, name, copy=False):
    """An optimizer's per-parameter state (a dict) with each tensor resolved (with
    `copy`, a full tensor's slice copied, not a view keeping the whole alive)."""
    if not isinstance(state, dict):
        return state
    out = {}
    for k, v in state.items():
        r = resolve(v, mark, f"{name}.{k}")
        if copy and torch.is_tensor(v) and r is not v:
            r = r.clone()
        out[k] = r
    return out


def state_sources(state, mark):
    if not isinstance(state, dict):
        return [state]
    return [t for v in state.values() for t in sources(v, mark)]
