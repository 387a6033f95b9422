"""smp/model_state.py: state dicts of a DistributedModel across pipeline ranks, keyed by
the plain module's names. The exchange of entries between pp ranks and the gather to pp
rank 0 with closed-form answers, then a real pp=2 model over Gloo against the plain
module: full, local and gathered dicts, full and partial loads (before and after the
partition), strict errors, and the post-partition and post-step hooks."""
from smp import model_state


def test_alone_nothing_moves():
    got, names = model_state.exchange({"a": 1, "b": 2}, {"a", "z"})
    assert got == {} and names == {"a", "b"}


EXCHANGE = r"""
import smp
from smp import model_state
smp.init({"partitions": 3, "timeout_s": 60})
me = smp.pp_rank()
# Each rank gets what it needs and lacks, from the lowest pp rank holding it; what
# nobody holds is not there; the names are every rank's.
have = [{"a": "a0", "x": "x0"}, {"a": "a1", "b": "b1"}, {"b": "b2"}][me]
needed = [{"a", "b"}, {"a", "b", "c"}, {"a", "x", "b"}][me]
got, names = model_state.exchange(have, needed)
print("exchange", sorted(got.items()), sorted(names))
print("gather", model_state.gather_to_pp0({"r": me}))
"""


def test_exchange_and_gather_on_three_pp_ranks(ranks):
    res = ranks(EXCHANGE, 3)
    want = ["[('b', 'b1')]", "[]", "[('a', 'a0'), ('x', 'x0')]"]
    for r in res:
        lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
        assert lines["exchange"] == f"{want[r.rank]} ['a', 'b', 'x']", r
        assert lines["gather"] == ("[{'r': 0}, {'r': 1}, {'r': 2}]" if r.rank == 0 else
                                   "None"), r


SCRIPT = r"""
import copy, torch, torch.nn as nn
import smp
smp.init({"partitions": 2, "microbatches": 2, "timeout_s": 60})
me = smp.pp_rank()

def show(tag, value):
    print(tag, repr(value), flush=True)

def make(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

def same(sd, want):
    return list(sd) == list(want) and all(torch.equal(sd[k], v) for k, v in want.items())

net, other, third = make(0), make(1), make(2)
model = smp.DistributedModel(net)
calls = []
model.register_post_partition_hook(lambda m, o: calls.append("partition"))
model.register_post_step_hook(lambda m, o: calls.append("step"))
show("before", sorted(model.local_state_dict()))
# Before the first step a load waits for the partition (SMP v1).
show("deferred", model.load_state_dict(other.state_dict()))

@smp.step
def forward(x):
    return model(x)

forward(torch.ones(4, 4))
show("calls", calls)
forward(torch.ones(4, 4))
show("calls again", calls)
model.register_post_partition_hook(lambda m, o: calls.append("late"))
show("late", calls[-1])

show("full", same(model.state_dict(), other.state_dict()))
local = model.local_state_dict()
show("partial flag", local.pop("_smp_is_partial"))
everyone = smp.allgather(sorted(local))
keys = list(other.state_dict())
show("local split", sorted(everyone[0] + everyone[1]) == sorted(keys)
     and not set(everyone[0]) & set(everyone[1]) and all(everyone))
gathered = model.state_dict(gather_to_rank0=True)
show("gathered", same(gathered, other.state_dict()) if me == 0 else dict(gathered))
show("plan hash", len(set(smp.allgather(model._plan_hash))) == 1 and model._plan_hash != 0)

# A partial dict split otherwise than the ownership: the ranks exchange the entries.
plain = third.state_dict()
part = {k: v for i, (k, v) in enumerate(plain.items()) if i % 2 == me}
part["_smp_is_partial"] = True
result = model.load_state_dict(part)
show("partial load", (same(model.state_dict(), plain), result.missing_keys,
                      result.unexpected_keys))
model.load_state_dict(other.state_dict())
show("full load", same(model.state_dict(), other.state_dict()))

try:
    model.load_state_dict({"0.weight": torch.zeros(8, 4), "bogus": torch.zeros(1)})
except RuntimeError as e:
    show("strict", str(e))
loose = model.load_state_dict({"0.weight": torch.zeros(8, 4), "bogus": torch.zeros(1)},
                              strict=False)
show("loose", (loose.missing_keys, loose.unexpected_keys))
try:
    model.register_post_step_hook(3)
except ValueError as e:
    show("hook", str(e))
"""


def test_state_dicts_of_a_two_stage_model_match_the_plain_module(ranks):
    res = ranks(SCRIPT, 2)
    keys = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    for r in res:
        out = {}
        for line in r.stdout.splitlines():
            # Longest first: "full load" is not "full".
            for tag in ("before", "deferred", "calls again", "calls",
                        "late", "full load", "full", "partial flag", "local split",
                        "gathered", "plan hash", "partial load", "strict", "loose", "hook"):
                if line.startswith(tag + " "):
                    out[tag] = line[len(tag) + 1:]
                    break
        assert out["before"] == repr(sorted(keys + ["_smp_is_partial"])), r
        assert out["deferred"] == "None", r
        assert out["calls"] == "['partition', 'step']", r
        assert out["calls again"] == "['partition', 'step']", r  # a post-step hook runs once
        assert out["late"] == "'late'", r  # registered after the partition: runs at once
        assert out["full"] == "True", r  # the deferred load took effect
        assert out["partial flag"] == "True", r
        assert out["local split"] == "True", r
        assert out["gathered"] == ("True" if r.rank == 0 else "{}"), r
        assert out["plan hash"] == "True", r
        assert out["partial load"] == "(True, [], [])", r
        assert out["full load"] == "True", r
        assert out["strict"] == repr(
            f"smp: load_state_dict on rank {r.rank} (pp rank {r.rank}): missing keys "
            f"{keys[1:]}, unexpected keys ['bogus']"), r
        assert out["loose"] == repr((keys[1:], ["bogus"])), r
        assert out["hook"] == "'smp: register_post_step_hook hook=3 is not callable'", r
