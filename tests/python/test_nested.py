"""smp.nested: the one walker over nested containers. No processes."""
import collections

import torch

from smp.nested import (TensorSlot, flatten, leaves, map_leaves, same_sequence,
                        tensor_leaves, unflatten)

Pair = collections.namedtuple("Pair", "a b")


def test_flatten_then_unflatten_gives_back_the_structure_and_the_same_objects():
    x, y = torch.ones(2), torch.zeros(3)
    value = ([x, {"k": y, "n": 3}], Pair(x, "s"), (None, 1.5))
    tensors = []
    skeleton = flatten(value, tensors)
    assert tensors == [x, y] or (tensors[0] is x and tensors[1] is y)
    assert len(tensors) == 2  # x appears twice, travels once
    back = unflatten(skeleton, tensors)
    assert back[0][0] is x and back[0][1]["k"] is y and back[0][1]["n"] == 3
    assert isinstance(back[1], Pair) and back[1].a is x and back[1].b == "s"
    assert back[2] == (None, 1.5)


def test_a_tensor_passed_twice_is_one_slot():
    h = torch.randn(4)
    tensors = []
    skeleton = flatten((h, h, h), tensors)
    assert len(tensors) == 1 and all(isinstance(s, TensorSlot) and s.index == 0 for s in skeleton)
    q, k, v = unflatten(skeleton, [torch.zeros(4)])
    assert q is k is v


def test_map_leaves_keeps_container_types_and_other_objects():
    od = collections.OrderedDict([("b", 1), ("a", 2)])
    out = map_leaves([od, (3, "x")], lambda n: n * 10, lambda v: isinstance(v, int))
    assert type(out[0]) is collections.OrderedDict and list(out[0].items()) == [("b", 10), ("a", 20)]
    assert out[1] == (30, "x")


def test_leaves_visit_in_map_order():
    value = {"z": [1, (2, 3)], "a": 4}
    assert leaves(value, lambda v: isinstance(v, int)) == [1, 2, 3, 4]
    t = torch.ones(1)
    assert tensor_leaves([t, {"u": t}]) == [t, t]


def test_same_sequence_rebuilds_lists_tuples_and_namedtuples():
    assert same_sequence([0], (1, 2)) == [1, 2]
    assert same_sequence((0,), [1, 2]) == (1, 2)
    assert same_sequence(Pair(0, 0), [1, 2]) == Pair(1, 2)


def test_a_slot_pickles_small():
    import pickle
    assert pickle.loads(pickle.dumps(TensorSlot(7))).index == 7
    assert len(pickle.dumps(TensorSlot(7))) < 60
