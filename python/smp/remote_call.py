"""What only Python can do for a remote call: pickle the structure of arguments and
outputs that are not plain tensors, and rebuild it.

A remote call is made in C++ (`smp._C.Caller`, Note [Known calls] in smp_core/call.h)
and served in C++ (`smp._C.Server`, Note [Known forward requests] in
smp_core/serve.h); their metadata has one encoder, in C++ (Note [Call metadata] in
smp_core/call_meta.h). A call whose tensors are passed positionally, each once, and
that returns one tensor needs nothing from here. Any other call hands its structure
to these functions: `flatten_args` on the caller, `unflatten_args` and
`flatten_outputs` on the owner, `unflatten_outputs` back on the caller.

`encode_request`, `encode_outputs`, `request_plan` and `decode` give Python's view of
the C++ encoding (tests, tools): they convert as the two sides do and call its encoder.
"""
import pickle

import torch

import smp._C as _C
from smp.memo import Memo
from smp.nested import TensorSlot, flatten, unflatten

__all__ = []

# Decoded skeletons repeat every microbatch and every step (smp/memo.py).
_DECODED = Memo()

_SCALARS = (int, float, complex, bool, str, bytes, type(None), TensorSlot, torch.dtype,
            torch.device)


def _shareable(value):
    """Whether every leaf of `value` is an immutable scalar (containers are rebuilt by
    unflatten; any other object could be changed in place by the module it is passed to)."""
    if isinstance(value, (list, tuple)):
        return all(_shareable(v) for v in value)
    if isinstance(value, dict):
        return all(_shareable(k) and _shareable(v) for k, v in value.items())
    return isinstance(value, _SCALARS)


def _unpickle(blob):
    """pickle.loads of a pickled skeleton, cached: a call's structure repeats every
    microbatch and every step. Only values made of immutable scalars are cached (a
    fresh object each time otherwise)."""
    return _DECODED.get(blob, lambda: pickle.loads(blob), keep=_shareable)


# --- the hooks of the C++ caller and server -----------------------------------------

def flatten_args(args, kwargs):
    """(pickled skeleton, tensors) of a call's arguments (Caller's `flatten`)."""
    tensors = []
    skeleton = flatten((args, kwargs), tensors)
    return pickle.dumps(skeleton), tensors


def unflatten_args(skeleton, tensors):
    """(args, kwargs) of a general request, from its pickled skeleton and tensors."""
    return unflatten(_unpickle(skeleton), tensors)


def flatten_outputs(out):
    """A module's output as its answer carries it: the tensor itself, or (pickled
    skeleton, tensors)."""
    if isinstance(out, torch.Tensor):  # the usual case: one tensor
        return out
    tensors = []
    skeleton = flatten(out, tensors)
    return pickle.dumps(skeleton), tensors


def unflatten_outputs(skeleton, tensors):
    """What the module returned, from its answer's pickled skeleton and tensors
    (Caller's `unflatten`)."""
    return unflatten(_unpickle(skeleton), tensors)


# --- Python's view of the C++ encoding ----------------------------------------------

def encode_request(name, args, kwargs, tensors, grad, flags):
    """The REQUEST metadata of calling module `name` with (args, kwargs) under grad mode
    `grad` and mode flags `flags`, as Caller encodes it; appends the tensors that travel
    to `tensors`."""
    skeleton, mine = _C.call_args(args, kwargs, flatten_args)
    tensors.extend(mine)
    return _C.encode_request(name, [t.requires_grad for t in mine], grad, flags, skeleton)


def request_plan(meta):
    """A REQUEST's decoded metadata (module name, argument skeleton, which tensors
    require grad, grad mode, mode flags) and whether the arguments are just the
    tensors, positionally."""
    name, requires_grad, grad, flags, skeleton = _C.decode_request(meta)
    if skeleton is None:
        return (name, (tuple(TensorSlot(i) for i in range(len(requires_grad))), {}),
                requires_grad, grad, flags, True)
    return name, _unpickle(skeleton), requires_grad, grad, flags, False


def encode_outputs(out, outs):
    """The RESPONSE metadata for module output `out`, as Server encodes it; appends its
    tensors to `outs`."""
    flat = flatten_outputs(out)
    if isinstance(flat, torch.Tensor):
        outs.append(flat)
        return _C.encode_answer([flat.requires_grad], None)
    skeleton, tensors = flat
    outs.extend(tensors)
    return _C.encode_answer([t.requires_grad for t in tensors], skeleton)


def decode(meta):
    """Metadata decoded: an answer's (skeleton, which outputs require grad) from the
    C++ encoding; anything else is pickled, and unpickled (cached: see _unpickle)."""
    if meta[:1] == b"A":  # Note [Call metadata]: an answer's tag (a pickle starts b"\x80")
        requires_grad, skeleton = _C.decode_answer(meta)
        return (TensorSlot(0) if skeleton is None else _unpickle(skeleton)), requires_grad
    return _unpickle(meta)
