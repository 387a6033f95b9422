"""smp/placement.py: applying a plan to the user's module in place (routing by class,
Sequential segments, released storage, mode flags), finding tied tensors, and keeping
tied copies equal across real pp ranks over Gloo."""
import copy

import torch
import torch.nn as nn

from smp import placement


class Calls:
    """The engine side of routing: placement hands a remote module's call to
    `engine.call(name, owner, args, kwargs)`. This one records the call and answers
    with a marker, so the test sees exactly what would have been sent."""

    def __init__(self):
        self.owned, self.subtrees, self.sent = {}, {}, []

    def call(self, name, owner, args, kwargs):
        self.sent.append((name, owner, len(args), sorted(kwargs)))
        return args[0] + 1000


def table_of(root):
    return [(n, m) for n, m in root.named_modules()]


def test_subtrees_are_contiguous_runs_of_the_preorder_table():
    net = nn.Sequential(nn.Linear(1, 1), nn.Sequential(nn.ReLU(), nn.Tanh()), nn.ReLU())
    sub = placement.subtrees(table_of(net))
    names = {k: [n for n, m in net.named_modules() if any(m is x for x in v)]
             for k, v in sub.items()}
    assert names == {"": ["", "0", "1", "1.0", "1.1", "2"], "0": ["0"],
                     "1": ["1", "1.0", "1.1"], "1.0": ["1.0"], "1.1": ["1.1"], "2": ["2"]}
    # "1" is not a prefix-match of "10".
    wide = nn.Sequential(*[nn.ReLU() for _ in range(11)])
    assert len(placement.subtrees(table_of(wide))["1"]) == 1


def test_mode_flags_travel_and_apply():
    mods = [nn.Linear(1, 1), nn.Dropout(), nn.ReLU()]
    mods[1].eval()
    flags = placement.mode_flags(mods)
    assert flags == b"\x01\x00\x01"
    others = copy.deepcopy(mods)
    for m in others:
        m.train()
    placement.apply_mode_flags(others, flags)
    assert [m.training for m in others] == [True, False, True]


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(5, 3)
        self.mid = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        return self.head(self.mid(self.tok(idx)))


def test_find_tied_names_each_tensor_by_its_first_name_with_sorted_holders():
    net = Tied()
    owner = {"": 0, "tok": 2, "mid": 1, "head": 0}
    tied, holders = placement.find_tied(table_of(net), owner, me=1)
    assert [(n, t is net.tok.weight, h) for n, t, h in tied.entries] == [("tok.weight", True, [0, 2])]
    assert holders[id(net.mid.weight)] == {1}
    assert tied.holds(net.tok.weight) and not tied.holds(net.mid.weight)
    # A tied tensor counts once in global norms: on its lowest holder.
    assert not tied.is_counted_here(net.tok.weight)
    assert placement.find_tied(table_of(net), owner, me=0)[0].is_counted_here(net.tok.weight)
    assert tied.is_counted_here(net.mid.weight)  # not tied: counted where held


def test_apply_routes_remote_modules_and_releases_what_others_hold():
    net = Tied()
    idx = torch.tensor([[1, 2]])
    owner = {"": 0, "tok": 0, "mid": 1, "head": 0}
    engine, table = Calls(), table_of(net)
    tied = placement.apply(table, owner, engine, me=0)
    try:
        assert set(engine.owned) == {"", "tok", "head"}
        assert isinstance(net.mid, nn.Linear) and type(net.mid).__name__ == "Linear"
        assert type(net.mid) is not nn.Linear  # the routing subclass
        # Storage of what only pp rank 1 holds is released; the Parameter objects stay.
        assert net.mid.weight.numel() == 0 and net.mid.bias.numel() == 0
        assert net.tok.weight.shape == (5, 3)  # held here (tok and head)
        assert tied.entries == []  # tok and head are both on pp rank 0
        out = net(idx)
        assert engine.sent == [("mid", 1, 1, [])]
        assert out.shape == (1, 2, 5)
    finally:
        placement.restore_classes(table)
    assert type(net.mid) is nn.Linear


def test_a_run_of_remote_children_of_a_sequential_is_one_call():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    owner = {"": 0, "0": 0, "1": 1, "2": 1, "3": 1, "4": 0}
    engine, table = Calls(), table_of(net)
    placement.apply(table, owner, engine, me=0)
    try:
        net(torch.ones(1, 2))
        assert engine.sent == [("1..3", 1, 1, [])]  # one round trip for three children
        assert [id(m) for m in engine.subtrees["1..3"]] == [id(net[i]) for i in (1, 2, 3)]
        engine.sent.clear()
        net[2](torch.ones(1, 2))  # a child called alone still routes itself
        assert engine.sent == [("2", 1, 1, [])]
        # A copy of a routed module is no route: it runs where it is.
        assert copy.deepcopy(net[1])(-torch.ones(1, 2)).tolist() == [[0.0, 0.0]]
        assert len(engine.sent) == 1
    finally:
        placement.restore_classes(table)
    assert type(net) is nn.Sequential


def test_the_owner_of_a_segment_serves_it_as_one_sequential():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    owner = {"": 0, "0": 0, "1": 1, "2": 1}
    engine, table = Calls(), table_of(net)
    placement.apply(table, owner, engine, me=1)
    try:
        seg = engine.owned["1..2"]
        assert isinstance(seg, nn.Sequential) and list(seg) == [net[1], net[2]]
        assert set(engine.owned) == {"1", "2", "1..2"}
        assert net[0].weight.numel() == 0 and net[2].weight.shape == (2, 2)
    finally:
        placement.restore_classes(table)


# --- tied copies on three real pp ranks -----------------------------------------------

SCRIPT = r"""
import torch
import smp
from smp import placement
smp.init({"partitions": 3, "timeout_s": 60})
me = smp.pp_rank()
a = torch.nn.Parameter(torch.full((2, 3), float(me + 1)))    # held by pp ranks 0, 1, 2
b = torch.nn.Parameter(torch.full((4,), 10.0 * (me + 1)))    # held by pp ranks 0 and 2
tied = placement.TiedParameters([("a", a, [0, 1, 2]), ("b", b, [0, 2])], me)
tied.connect()  # the holders' groups, as apply() makes them
if me == 1:
    b.data = torch.empty(0)  # released where it is not held, as apply() does

tied.sync_values()  # every holder takes the lowest holder's value
print("sync", a.flatten().tolist(), b.flatten().tolist())

a.grad = torch.full((2, 3), 0.5)  # accumulated before this step
tied.begin_step()
a.grad = torch.full((2, 3), float(me))   # this step: 0 + 1 + 2 summed
if me != 1:
    b.grad = torch.full((4,), float(me + 1))   # 1 + 3 on the holders
tied.sum_grads()
print("grads", a.grad.flatten().tolist(), None if me == 1 else b.grad.flatten().tolist())

tied.begin_step()  # a step without backward gives the gradients back
tied.restore_grads()
print("kept", a.grad.flatten().tolist())

tied.check_copies()  # equal: nothing raised
print("equal")
if me == 2:
    with torch.no_grad():
        a.add_(1e-3)  # one copy drifts
try:
    tied.check_copies()
except placement.TiedCopiesError as e:
    print("drift", str(e).split(":")[1].strip())
"""


def test_tied_copies_on_three_pp_ranks(ranks):
    res = ranks(SCRIPT, 3)
    for r in res:
        lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
        assert lines["sync"] == str([1.0] * 6) + " " + str([10.0] * 4 if r.rank != 1 else []), r
        b_grad = "None" if r.rank == 1 else str([4.0] * 4)
        assert lines["grads"] == str([3.5] * 6) + " " + b_grad, r
        assert lines["kept"] == str([3.5] * 6), r
        assert "equal" in r.stdout.split(), r
        assert lines["drift"] == "the copies of tied parameter 'a' on pp ranks [0, 1, 2] differ", r
