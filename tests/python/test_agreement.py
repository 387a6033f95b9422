"""smp/agreement.py: the model signature and the text of a mismatch, the restore of
what a trace changes, and `agree` (every rank raises the same error, or none does),
alone and on three real ranks over Gloo."""
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import smp
from smp import agreement


# --- signature and describe_mismatch (no processes) ----------------------------------

def test_signature_lists_modules_parameters_and_buffers_in_order():
    net = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    assert agreement.signature(net) == [
        ("module", "", "Sequential", ""), ("module", "0", "Linear", ""),
        ("module", "1", "BatchNorm1d", ""),
        ("parameter", "0.weight", (2, 3), "torch.float32"),
        ("parameter", "0.bias", (2,), "torch.float32"),
        ("parameter", "1.weight", (2,), "torch.float32"),
        ("parameter", "1.bias", (2,), "torch.float32"),
        ("buffer", "1.running_mean", (2,), "torch.float32"),
        ("buffer", "1.running_var", (2,), "torch.float32"),
        ("buffer", "1.num_batches_tracked", (), "torch.int64"),
    ]


def sig(*layers):
    return agreement.signature(nn.Sequential(*layers))


def test_a_shape_difference_names_the_parameter_the_shapes_and_the_ranks():
    a, b = sig(nn.Linear(4, 4)), sig(nn.Linear(4, 5))
    assert agreement.describe_mismatch([a, a, b]) == (
        "smp: the model differs between ranks at entry 2: parameter '0.weight' of shape "
        "[4, 4] and torch.float32 on ranks 0,1; parameter '0.weight' of shape [5, 4] and "
        "torch.float32 on rank 2 (parameter counts by rank: [2, 2, 2]). Every rank must "
        "build the same model before smp.DistributedModel")


def test_a_missing_entry_and_a_module_type_are_named():
    short, longer = sig(nn.Linear(2, 2)), sig(nn.Linear(2, 2), nn.Linear(2, 2))
    text = agreement.describe_mismatch([longer, short])
    assert text.startswith("smp: the model differs between ranks at entry 2: module '1' "
                           "(Linear) on rank 0; parameter '0.weight' of shape [2, 2] and "
                           "torch.float32 on rank 1"), text
    assert "(parameter counts by rank: [4, 2])" in text
    relu, tanh = sig(nn.ReLU()), sig(nn.Tanh())
    assert agreement.describe_mismatch([relu, tanh]).startswith(
        "smp: the model differs between ranks at entry 1: module '0' (ReLU) on rank 0; "
        "module '0' (Tanh) on rank 1")
    # One rank has an entry the others lack altogether.
    text = agreement.describe_mismatch([short + [("buffer", "x", (1,), "torch.float32")], short])
    assert "buffer 'x' of shape [1] and torch.float32 on rank 0; nothing on rank 1" in text


def test_equal_signatures_have_no_difference_to_name():
    s = sig(nn.Linear(2, 2))
    assert agreement.describe_mismatch([s, s]) == "smp: the model differs between ranks"


# --- snapshot_side_effects (no processes) --------------------------------------------

def test_the_snapshot_restores_buffers_and_every_random_state():
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    buffers = [b.clone() for b in net.buffers()]
    restore = agreement.snapshot_side_effects(net)
    want = (random.random(), torch.rand(3), np.random.rand())
    restore()
    net.train()
    net(torch.randn(4, 2))  # BatchNorm updates its statistics and counter
    assert not torch.equal(net[1].running_mean, buffers[0])
    restore()
    for b, saved in zip(net.buffers(), buffers):
        assert torch.equal(b, saved)
    got = (random.random(), torch.rand(3), np.random.rand())
    assert got[0] == want[0] and torch.equal(got[1], want[1]) and got[2] == want[2]


# --- agree and first_error (one process: nothing is gathered) ------------------------

def test_first_error_raises_a_config_error_for_a_value_error_else_a_runtime_error():
    verdict = agreement.first_error("the first step")
    e = verdict([(2, "ValueError", "bad x"), (3, "RuntimeError", "other")], 4)
    assert type(e) is smp.ConfigError
    assert str(e) == "bad x (rank 2, in the first step; raised on every rank)"
    e = verdict([(1, "ConfigError", "bad y")], 2)
    assert type(e) is smp.ConfigError
    e = verdict([(0, "KeyError", "'k'")], 2)
    assert type(e) is RuntimeError and str(e) == "'k' (rank 0, in the first step; raised on every rank)"


def test_agree_alone_returns_the_value_or_raises_the_verdict():
    assert not smp.is_initialized()
    verdict = agreement.first_error("t")
    assert agreement.agree(None, smp.WORLD, verdict, value={"a": 1}) == [{"a": 1}]
    with pytest.raises(RuntimeError, match=r"^boom \(rank 0, in t; raised on every rank\)$"):
        agreement.agree(RuntimeError("boom"), smp.WORLD, verdict)
    mine = KeyError("mine")
    with pytest.raises(KeyError) as info:
        agreement.agree(mine, smp.WORLD, verdict, own_first=True)
    assert info.value is mine  # its own object, traceback intact
    seen = []
    agreement.agree(None, smp.WORLD, lambda f, n: seen.append((f, n)))
    assert seen == []  # no error: the verdict is never asked


# --- agree on three real ranks --------------------------------------------------------

SCRIPT = r"""
import torch.nn as nn
import smp
from smp import agreement
smp.init({"partitions": 3, "timeout_s": 60})
r = smp.rank()
first = agreement.first_error("the test")

def outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e))

# No error anywhere: every rank's value, in rank order.
print("values", agreement.agree(None, smp.WORLD, first, value=r * 10))
# Ranks 1 and 2 fail differently: every rank raises rank 1's, as a ConfigError.
err = {1: ValueError("bad one"), 2: RuntimeError("bad two")}.get(r)
print("first", outcome(lambda: agreement.agree(err, smp.PP_GROUP, first, value=r)))
# own_first: rank 1 raises its own object; the others the verdict.
mine = KeyError("own") if r == 1 else None
try:
    agreement.agree(mine, smp.WORLD, first, own_first=True)
except Exception as e:  # noqa: BLE001
    print("own", type(e).__name__, str(e), e is mine)
# The verdict sees every failure and the group's size.
seen = []
def verdict(failures, size):
    seen.append((failures, size))
    return RuntimeError("v")
print("verdict", outcome(lambda: agreement.agree(
    RuntimeError(f"e{r}") if r != 1 else None, smp.WORLD, verdict)), seen)
# A group of one rank (dp, with partitions=3) gathers nothing: only rank 2 raises.
print("alone", outcome(lambda: agreement.agree(RuntimeError("solo") if r == 2 else None,
                                               smp.DP_GROUP, first, value=r)))
# After all that, the ranks are still in step: one more collective agrees.
print("after", smp.allgather(r))
# The first step's check: rank 2 built another model.
net = nn.Sequential(nn.Linear(4, 5 if r == 2 else 4))
print("mismatch", outcome(lambda: agreement.agree_on_first_step(net)))
print("input", outcome(lambda: agreement.agree_on_first_step(
    nn.Linear(1, 1), ValueError("bad batch") if r == 0 else None)))
"""


def test_agree_on_three_ranks(ranks):
    res = ranks(SCRIPT, 3)
    for r in res:
        lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
        assert lines["values"] == "[0, 10, 20]", r
        assert lines["first"] == ("('ConfigError', 'bad one (rank 1, in the test; raised on "
                                  "every rank)')"), r
        if r.rank == 1:
            assert lines["own"] == "KeyError 'own' True", r
        else:
            assert lines["own"] == ("RuntimeError 'own' (rank 1, in the test; raised on every "
                                    "rank) False"), r
        assert lines["verdict"] == ("('RuntimeError', 'v') [([(0, 'RuntimeError', 'e0'), "
                                    "(2, 'RuntimeError', 'e2')], 3)]"), r
        assert lines["alone"] == ("('RuntimeError', 'solo (rank 0, in the test; raised on "
                                  "every rank)')" if r.rank == 2 else "('ok', [%d])" % r.rank), r
        assert lines["after"] == "[0, 1, 2]", r
        assert lines["mismatch"] == (
            "('ModelMismatchError', \"smp: the model differs between ranks at entry 2: "
            "parameter '0.weight' of shape [4, 4] and torch.float32 on ranks 0,1; parameter "
            "'0.weight' of shape [5, 4] and torch.float32 on rank 2 (parameter counts by "
            "rank: [2, 2, 2]). Every rank must build the same model before "
            "smp.DistributedModel\")"), r
        assert lines["input"] == ("('ConfigError', 'bad batch (rank 0, in the first step; "
                                  "raised on every rank)')"), r
