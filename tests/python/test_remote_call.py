"""The metadata of remote calls (smp/remote_call.py): the cached fast paths give what the
general encoding gives, and nothing a module could change in place is shared between
calls. No processes: these are the pure functions both ends use."""
import pickle

import numpy as np
import pytest
import torch

from smp.nested import TensorSlot, flatten, unflatten
from smp import _C
from smp.remote_call import decode, encode_outputs, encode_request, request_plan


def _general(name, args, kwargs, grad, flags):
    tensors = []
    skeleton = flatten((args, kwargs), tensors)
    return tensors, (name, skeleton, [t.requires_grad for t in tensors], grad, flags)


def _structure(skeleton):
    """The skeleton with slot i replaced by the number i: comparable with ==."""
    return unflatten(skeleton, list(range(8)))


def test_positional_tensors_encode_like_the_general_path_and_run_positionally():
    x, y = torch.ones(2, requires_grad=True), torch.zeros(3)
    tensors = []
    meta = encode_request("layer", (x, y), {}, tensors, True, b"\x01\x00")
    assert tensors == [x, y]
    name, skeleton, requires_grad, grad, flags, positional = request_plan(meta)
    _, general = _general("layer", (x, y), {}, True, b"\x01\x00")
    assert (name, requires_grad, grad, flags) == ("layer", [True, False], True, b"\x01\x00")
    assert positional
    assert _structure(skeleton) == _structure(general[1])
    # The same call again: the same bytes (cached), still decoded alike.
    assert encode_request("layer", (x, y), {}, [], True, b"\x01\x00") == meta
    # Another requires-grad pattern is another entry.
    other = encode_request("layer", (x.detach(), y), {}, [], True, b"\x01\x00")
    assert request_plan(other)[2] == [False, False]


def test_keyword_and_nested_arguments_take_the_general_path():
    x = torch.ones(2)
    for args, kwargs in [((x,), {"scale": 2.0}), (([x, x],), {}), ((x, 3), {})]:
        tensors = []
        meta = encode_request("m", args, kwargs, tensors, False, b"")
        name, skeleton, requires_grad, grad, flags, positional = request_plan(meta)
        assert not positional
        got_args, got_kwargs = unflatten(skeleton, tensors)
        assert len(got_args) == len(args) and got_kwargs == kwargs


def test_one_tensor_output_meta_decodes_to_the_general_form():
    for rg in (False, True):
        out = torch.ones(2, requires_grad=rg) * 1
        outs = []
        meta = encode_outputs(out, outs)
        assert outs == [out]
        skeleton, flags = decode(meta)
        assert isinstance(skeleton, TensorSlot) and skeleton.index == 0 and flags == [rg]
    outs = []
    skeleton, flags = decode(encode_outputs((torch.ones(1), {"a": torch.zeros(1)}), outs))
    assert len(outs) == 2 and flags == [False, False]
    assert isinstance(unflatten(skeleton, outs)[1]["a"], torch.Tensor)


def test_malformed_gradient_flags_are_named():
    with pytest.raises(RuntimeError, match="flags 2 tensors, expected 3"):
        _C.parse_gradient_flags(b"\x01\x00", 3, "the input gradients of 'x'")
    with pytest.raises(RuntimeError, match="flag byte 7 .allowed: 0, 1."):
        _C.parse_gradient_flags(b"\x01\x07", 2)


def test_objects_a_module_could_change_are_never_shared_between_calls():
    arr = np.zeros(3)
    meta = pickle.dumps(("m", ((TensorSlot(0), arr), {}), [False], False, b""))
    first = decode(meta)
    first[1][0][1][0] = 42.0  # a module writing into its argument
    second = decode(meta)
    assert second[1][0][1][0] == 0.0 and second is not first
    # Immutable scalars only: cached and shared.
    plain = pickle.dumps(("m", ((TensorSlot(0), 3, "s", None), {}), [False], True, b""))
    assert decode(plain) is decode(plain)


def test_a_tensor_passed_twice_travels_once_and_arrives_as_one_object():
    # attn(h, h, h): torch's MultiheadAttention takes another path when query is not
    # key, and an in-place change of one argument must show in the other.
    h, other = torch.ones(2, 3), torch.zeros(1)
    tensors = []
    meta = encode_request("attn", (h, h, other, h), {}, tensors, False, b"")
    assert len(tensors) == 2 and tensors[0] is h and tensors[1] is other
    name, skeleton, requires_grad, grad, flags, positional = request_plan(meta)
    assert not positional
    args, kwargs = unflatten(skeleton, [t.clone() for t in tensors])
    assert args[0] is args[1] is args[3] and args[2] is not args[0]
    outs = []
    encode_outputs((h, [h, other]), outs)
    assert len(outs) == 2
