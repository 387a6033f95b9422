"""smp/tracer.py: the module table, what a trace records (call order, counts, bytes),
and the plan the C++ partitioner makes of the records. No processes: the trace is one
microbatch through the module in this process."""
import types

import pytest
import torch
import torch.nn as nn

import smp
from smp import core, tracer


class Net(nn.Module):
    """A shared layer called twice, a layer never called, nested containers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 3)
        self.blocks = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Tanh(), nn.Linear(3, 2)))
        self.shared = nn.Linear(2, 2)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.shared(self.shared(self.blocks(self.embed(x))))


def test_module_table_is_preorder_with_parent_indices():
    net = Net()
    net.alias = net.shared  # one module under two names: listed once
    names = [(n, type(m).__name__, p) for n, m, p in tracer.module_table(net)]
    assert names == [
        ("", "Net", -1), ("embed", "Linear", 0), ("blocks", "Sequential", 0),
        ("blocks.0", "Linear", 2), ("blocks.1", "Sequential", 2), ("blocks.1.0", "Tanh", 4),
        ("blocks.1.1", "Linear", 4), ("shared", "Linear", 0), ("unused", "Linear", 0),
    ]


def records_of(net, x, **kw):
    trace = tracer.Trace(net, **kw)
    with trace, torch.no_grad():
        net(x)
    return {r["name"]: r for r in trace.nodes()}


def test_a_trace_records_order_calls_and_bytes():
    net = Net()
    rec = records_of(net, torch.randn(5, 4))
    order = sorted((r["first_call"], n) for n, r in rec.items() if r["first_call"] >= 0)
    assert [n for _, n in order] == ["", "embed", "blocks", "blocks.0", "blocks.1",
                                     "blocks.1.0", "blocks.1.1", "shared"]
    assert rec["shared"]["calls"] == 2 and rec[""]["calls"] == 1
    assert rec["unused"]["calls"] == 0 and rec["unused"]["first_call"] == -1
    f32 = 4
    # Outputs, summed over calls: batch 5 x features.
    assert rec["embed"]["activation_bytes"] == 5 * 3 * f32
    assert rec["shared"]["activation_bytes"] == 2 * 5 * 2 * f32
    assert rec["blocks"]["activation_bytes"] == 5 * 2 * f32
    assert rec["unused"]["activation_bytes"] == 0
    # Parameters held directly: a container holds none.
    assert rec["embed"]["param_bytes"] == (4 * 3 + 3) * f32
    assert rec["blocks"]["param_bytes"] == 0 and rec[""]["param_bytes"] == 0
    # Parents by index into the table.
    assert rec["blocks.1.1"]["parent"] == 4 and rec[""]["parent"] == -1
    # Not measured: -1; no CUDA here (or not asked): no memory either.
    assert {r["time_ms"] for r in rec.values()} == {-1.0}
    assert {r["mem_bytes"] for r in rec.values()} == {-1}
    assert {r["manual_partition"] for r in rec.values()} == {-1}


def test_times_are_recorded_when_asked_and_hooks_are_gone_afterwards():
    net = Net()
    trace = tracer.Trace(net, measure_time=True)
    with trace, torch.no_grad():
        net(torch.randn(2, 4))
    net(torch.randn(2, 4))  # after the trace: not recorded
    rec = {r["name"]: r for r in trace.nodes()}
    assert rec["shared"]["calls"] == 2
    assert all(r["time_ms"] >= 0.0 for r in rec.values())
    assert rec["unused"]["time_ms"] == 0.0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_nested_outputs_count_every_tensor_once_per_call():
    class Pair(nn.Module):
        def forward(self, x):
            return {"a": x * 2, "b": [x[:1], 3]}

    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()

        def forward(self, x):
            out = self.pair(x)
            return out["a"] + out["b"][0]

    rec = records_of(Top(), torch.ones(3, 2, dtype=torch.float64))
    assert rec["pair"]["activation_bytes"] == (3 * 2 + 1 * 2) * 8
    assert rec[""]["activation_bytes"] == 3 * 2 * 8


def test_manual_partitions_are_recorded():
    with smp.partition(1):
        net = nn.Sequential(nn.Linear(2, 2))
        with smp.partition(0):
            net.append(nn.Linear(2, 2))
    net.append(nn.Linear(2, 2))
    rec = records_of(net, torch.ones(1, 2))
    assert [rec[n]["manual_partition"] for n in ("", "0", "1", "2")] == [1, 1, 0, -1]


@pytest.fixture
def config(monkeypatch):
    """core.state.cfg as smp.init leaves it, for make_plan (which only reads it)."""
    def set_config(**kw):
        cfg = dict(partitions=2, memory_weight=0.2, auto_partition=True, default_partition=0)
        cfg.update(kw)
        monkeypatch.setattr(core.state, "cfg", types.SimpleNamespace(**cfg))
    return set_config


def test_records_become_module_nodes():
    rec = list(records_of(Net(), torch.ones(1, 4)).values())
    nodes = tracer.to_module_nodes(rec)
    assert [n.name for n in nodes] == [r["name"] for r in rec]
    for n, r in zip(nodes, rec):
        assert (n.parent, n.param_bytes, n.activation_bytes, n.first_call, n.calls,
                n.manual_partition) == (r["parent"], r["param_bytes"], r["activation_bytes"],
                                        r["first_call"], r["calls"], r["manual_partition"])


def test_make_plan_splits_equal_layers_in_call_order(config):
    config(partitions=2)
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    records = list(records_of(net, torch.ones(2, 8)).values())
    nodes, plan = tracer.make_plan(records)
    by_name = dict(zip([n.name for n in nodes], plan.assignment))
    assert [by_name[str(i)] for i in range(4)] == [0, 0, 1, 1]
    # The same records always make the same plan (every rank compares its hash).
    assert tracer.make_plan(records)[1].hash == plan.hash


def test_make_plan_honours_manual_partitions_without_auto_partition(config):
    config(partitions=3, auto_partition=False, default_partition=2)
    with smp.partition(1):
        first = nn.Linear(2, 2)
    with smp.partition(0):
        second = nn.Linear(2, 2)
    net = nn.Sequential(first, second, nn.Linear(2, 2))
    records = list(records_of(net, torch.ones(1, 2)).values())
    nodes, plan = tracer.make_plan(records)
    by_name = dict(zip([n.name for n in nodes], plan.assignment))
    assert (by_name["0"], by_name["1"], by_name["2"]) == (1, 0, 2)


class _Wide(nn.Module):
    """Few parameters, a wide output (a parameter-free expansion of a narrow product)."""

    def __init__(self, n_in):
        super().__init__()
        self.w = nn.Parameter(torch.full((n_in, 16), 0.01))

    def forward(self, x):
        return (x @ self.w).repeat(1, 64)


def test_optimize_memory_counts_the_optimizer_state_a_stage_holds(config, monkeypatch):
    # An embedding-like layer (3 units of parameters, a narrow output) and three layers
    # with few parameters and 4 units of output each, balanced by memory alone
    # (partition_test.cpp's MemoryFactorsWeighParametersAgainstActivations, traced):
    # with a weight and its gradient per parameter the first layer shares a stage; with
    # AdamW's two states as well it gets a stage of its own. "speed" ignores the optimizer.
    net = nn.Sequential(nn.Linear(3072, 64), _Wide(64), _Wide(1024), _Wide(1024))
    records = list(records_of(net, torch.ones(256, 3072)).values())

    def first_split(optimize, optimizer):
        monkeypatch.setattr(core.state, "optimizer", optimizer)
        config(partitions=2, memory_weight=1.0, optimize=optimize, microbatches=1,
               active_microbatches=3)
        nodes, plan = tracer.make_plan(records)
        by_name = dict(zip([n.name for n in nodes], plan.assignment))
        return [by_name[str(i)] for i in range(4)]
    params = list(net.parameters())
    sgd = torch.optim.SGD(params, lr=0.1)
    adamw = torch.optim.AdamW(params)
    assert first_split("memory", sgd) == [0, 0, 1, 1]
    assert first_split("memory", adamw) == [0, 1, 1, 1]
    assert first_split("speed", adamw) == first_split("speed", sgd)
