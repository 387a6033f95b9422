"""One call of a module owned by another pp rank, as one node of the caller's autograd
graph: `Call.forward` sends the request and returns the owner's outputs; `Call.connect`
makes them outputs of a C++ autograd node whose backward sends the output gradients and
returns the input gradients the owner computed on the graph it kept for that call."""
import pickle

import torch

import smp._C as _C
from smp.memo import Memo
from smp.nested import TensorSlot, flatten, unflatten
from smp.timeline import timeline

__all__ = []

K = _C.MsgKind


_ANCHOR = None

# What repeats every microbatch and every step, memoized (smp/memo.py): decoded
# metadata, request plans and the metadata of positional requests.
_DECODED = Memo()
_PLANS = Memo()
_REQUESTS = Memo()


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


def request_plan(meta):
    """A REQUEST's decoded metadata (module name, argument skeleton, which inputs
    require grad, grad mode, mode flags) and whether the arguments are just the tensors,
    positionally (then the owner calls the module with them as they are), cached."""
    return _PLANS.get(meta, lambda: _plan(meta), keep=lambda _: meta in _DECODED)


def _plan(meta):
    name, skeleton, requires_grad, grad, flags = decode(meta)
    args, kwargs = skeleton
    positional = not kwargs and type(args) is tuple and all(
        type(a) is TensorSlot and a.index == i for i, a in enumerate(args))
    return (name, skeleton, requires_grad, grad, flags, positional)


# A single tensor output's RESPONSE metadata, by its requires_grad (also used by Note
# [Known forward requests] in python/csrc/bind_pipeline.cpp).
ONE_TENSOR = {rg: pickle.dumps((TensorSlot(0), [rg])) for rg in (False, True)}


def encode_request(name, args, kwargs, tensors, grad, flags):
    """The REQUEST metadata of calling module `name` with (args, kwargs); appends the
    tensors to `tensors`. Tensors passed positionally (the usual case) need no skeleton
    pickled per call: their metadata is cached."""
    if (not kwargs and all(isinstance(a, torch.Tensor) for a in args)
            and len({id(a) for a in args}) == len(args)):  # no tensor passed twice
        tensors.extend(args)
        key = (name, tuple(t.requires_grad for t in args), grad, flags)
        return _REQUESTS.get(key, lambda: pickle.dumps(
            (name, (tuple(TensorSlot(i) for i in range(len(args))), {}), list(key[1]), grad,
             flags)))
    skeleton = flatten((args, kwargs), tensors)
    return pickle.dumps((name, skeleton, [t.requires_grad for t in tensors], grad, flags))


def encode_outputs(out, outs):
    """The RESPONSE metadata for module output `out`; appends its tensors to `outs`."""
    if isinstance(out, torch.Tensor):  # the usual case: one tensor
        outs.append(out)
        return ONE_TENSOR[out.requires_grad]
    skeleton = flatten(out, outs)
    return pickle.dumps((skeleton, [t.requires_grad for t in outs]))


def decode(meta):
    """pickle.loads of a message's metadata, cached: a call's metadata (module name,
    argument structure, flags) repeats every microbatch and every step. Only values made
    of immutable scalars are cached (a fresh object each time otherwise)."""
    return _DECODED.get(meta, lambda: pickle.loads(meta), keep=_shareable)


def rebuild(skeleton, outs):
    """What the module returned, from its answer's skeleton and output tensors."""
    if type(skeleton) is TensorSlot:  # one tensor returned
        return outs[skeleton.index]
    return unflatten(skeleton, list(outs))


def anchor():
    """A scalar that requires grad, so every remote call is a node of the graph even
    when none of its inputs requires grad (the owner's parameters still need grads)."""
    global _ANCHOR
    if _ANCHOR is None:
        _ANCHOR = torch.zeros((), requires_grad=True)
    return _ANCHOR


class Call:
    """One remote call: its identity and the owner's answer. Its backward is a C++
    autograd node (`_C.connect_remote_call`, Note [Remote call node] in
    smp_core/remote_call.h): it sends the output gradients and takes the input gradients
    without entering Python."""

    def __init__(self, engine, name, owner, mb, call_id, meta):
        self.engine, self.name, self.owner, self.mb, self.call_id = engine, name, owner, mb, call_id
        self.meta = meta  # encode_request's
        self.out_skeleton = None
        self.out_requires_grad = []

    def forward(self, tensors):
        e = self.engine
        meta = self.meta
        with timeline.span(f"call {self.name}", mb=self.mb):
            msg = e.call_remote(self.owner,
                                _C.Message(self.mb, self.call_id, K.REQUEST, meta,
                                           [t.detach() for t in tensors]),
                                K.RESPONSE, f"the output of '{self.name}' (microbatch {self.mb}, "
                                f"call {self.call_id}) from pp rank {self.owner}")
        self.out_skeleton, self.out_requires_grad = decode(msg.meta)
        return msg.tensors

    def connect(self, tensors, outs):
        """`outs` (the answer), as outputs of the call's autograd node over `tensors`."""
        return _C.connect_remote_call(self.engine.dispatch, self.owner, self.mb, self.call_id,
                                      self.name, [anchor()] + tensors, outs,
                                      self.out_requires_grad)
