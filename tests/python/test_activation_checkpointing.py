"""smp.set_activation_checkpointing (smp/activation_checkpointing.py): a checkpointed
module's owner recomputes its forward in the backward, with the random numbers the
forward drew (Note [Checkpointed modules keep their random numbers]), so training with
checkpointing equals training without it, bit for bit, at any partitioning.

examples/gpt_checkpoint.py's GPT-style model (tied head, MultiheadAttention, Dropout
raised to 0.2) trains three AdamW steps; every run reports its losses, a SHA-256 of
every parameter and how often the checkpointed modules' forward ran.
"""
import json
import pathlib

import pytest

EXAMPLES = str(pathlib.Path(__file__).resolve().parents[2] / "examples")

TRAIN = r"""
import json, sys
import smp

opts = json.loads(sys.argv[1])
sys.path.insert(0, opts["examples"])
from gpt_checkpoint import CTX, GPT, VOCAB

from nets import gpt_job, train_gpt  # tests/python/nets.py
model, opt = gpt_job(smp, GPT, opts["cfg"])
calls = [0]
def count(module, args):
    if not smp.is_tracing():  # the trace runs every module once, on every rank
        calls[0] += 1
for b in model.get_module().blocks:
    if opts["mode"] == "blocks":  # SMP's usual call: each transformer layer
        smp.set_activation_checkpointing(b)
    elif opts["mode"] == "blocks-fresh-rng":
        smp.set_activation_checkpointing(b, preserve_rng_state=False)
    elif opts["mode"].startswith("mlp:"):  # an nn.Sequential, by strategy
        smp.set_activation_checkpointing(b.mlp, strategy=opts["mode"][4:])
    for layer in b.mlp:
        layer.register_forward_pre_hook(count)

losses, params = train_gpt(smp, model, opt, VOCAB, CTX)
calls = sum(smp.allgather(calls[0])) // smp.dp_size()
if smp.rank() == 0:
    print("RESULT " + json.dumps({"losses": losses, "params": params, "calls": calls}))
smp.shutdown()
"""


def _result(ranks, world, cfg, mode):
    res = ranks(TRAIN, world, args=(json.dumps({"cfg": cfg, "examples": EXAMPLES,
                                                 "mode": mode}),), timeout=240)
    line = next(l for l in res[0].stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _same_numbers(a, b):
    return a["losses"] == b["losses"] and a["params"] == b["params"]


@pytest.mark.parametrize("world,cfg", [
    (1, {}),
    (2, {"partitions": 2}),
    (4, {"partitions": 2, "ddp": True}),
    (2, {"partitions": 2, "pipeline": "zero_bubble"}),
], ids=["pp1", "pp2", "pp2xdp2", "pp2-zero_bubble"])
def test_checkpointed_blocks_train_as_without(ranks, world, cfg):
    plain = _result(ranks, world, cfg, "none")
    ckpt = _result(ranks, world, cfg, "blocks")
    assert _same_numbers(ckpt, plain), (ckpt, plain)
    # The checkpointed blocks' MLP layers ran again in every training backward: the
    # forward and the recomputation (under zero_bubble the weight half, a backward of
    # its own, recomputes again on pp rank 1).
    assert ckpt["calls"] >= 2 * plain["calls"], (ckpt, plain)


def test_without_preserved_rng_the_recomputation_draws_other_masks(ranks):
    # The comparison above can fail: recomputing with fresh random numbers changes the
    # Dropout masks the gradients see.
    plain = _result(ranks, 2, {"partitions": 2}, "none")
    fresh = _result(ranks, 2, {"partitions": 2}, "blocks-fresh-rng")
    assert fresh["losses"][0] == plain["losses"][0]  # the forward is the same
    assert fresh["params"] != plain["params"]


@pytest.mark.parametrize("strategy", ["each", "group_2", "contiguous"])
def test_sequential_strategies_train_as_without(ranks, strategy):
    plain = _result(ranks, 2, {"partitions": 2}, "none")
    ckpt = _result(ranks, 2, {"partitions": 2}, "mlp:" + strategy)
    assert _same_numbers(ckpt, plain), (ckpt, plain)
    assert ckpt["calls"] == 2 * plain["calls"], (ckpt, plain)


BAD = r"""
import sys
import torch, torch.nn as nn
import smp
smp.init({"partitions": 1})
net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
try:
    smp.set_activation_checkpointing(net[0])
except RuntimeError as e:
    print("before wrapping:", e)
model = smp.DistributedModel(net)
for args, kw in [((nn.Linear(4, 4),), {}), ((net,), {"strategy": "group_0"}),
                 ((net,), {"preserve_rng_state": "yes"}), (("net",), {})]:
    try:
        smp.set_activation_checkpointing(*args, **kw)
    except (TypeError, ValueError) as e:
        print(type(e).__name__ + ":", e)
"""


def test_bad_input_is_named(ranks):
    out = ranks(BAD, 1, timeout=60)[0].stdout
    assert ("before wrapping: smp.set_activation_checkpointing: no smp.DistributedModel yet; "
            "wrap the model first") in out, out
    assert ("ValueError: smp.set_activation_checkpointing: the Linear given is not a module "
            "of the smp.DistributedModel") in out, out
    assert ("ValueError: smp.set_activation_checkpointing: 'strategy'='group_0' is not one of "
            "{each, group_<n> (n >= 1), contiguous}") in out, out
    assert ("ValueError: smp.set_activation_checkpointing: 'preserve_rng_state'='yes' is not "
            "one of {True, False}") in out, out
    assert ("TypeError: smp.set_activation_checkpointing: 'module' must be an nn.Module, got "
            "str") in out, out


SEQ = r"""
import hashlib, json, sys
import torch, torch.nn as nn
import smp
opts = json.loads(sys.argv[1])
smp.init({"partitions": 2, "microbatches": 4})
torch.manual_seed(0)
net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.2))
                      for _ in range(8)], nn.Linear(32, 4))
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
if opts["strategy"]:
    smp.set_activation_checkpointing(model.get_module(), strategy=opts["strategy"])
calls = [0]
def count(module, args):
    if not smp.is_tracing():
        calls[0] += 1
for m in net.modules():
    if isinstance(m, nn.Linear):
        m.register_forward_pre_hook(count)
@smp.step
def train_step(x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    model.backward(loss)
    return loss
g = torch.Generator().manual_seed(7)
losses = []
for _ in range(3):
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
    losses.append(train_step(x, y).reduce_mean().item())
    opt.step()
    opt.zero_grad()
owners = {p["partition"] for p in model.partition_plan().values()}
state = model.state_dict()
digest = hashlib.sha256()
for k in sorted(state):
    digest.update(state[k].detach().contiguous().numpy().tobytes())
calls = sum(smp.allgather(calls[0]))
if smp.rank() == 0:
    print("RESULT " + json.dumps({"losses": losses, "params": digest.hexdigest(),
                                  "calls": calls, "partitions_used": len(owners)}))
"""


@pytest.mark.parametrize("strategy", ["each", "group_3", "contiguous"])
def test_a_sequential_across_pp_ranks_is_checkpointed_by_each_owner(ranks, strategy):
    # The Sequential's children sit on both pp ranks: pp rank 1 serves its run as one
    # call (Note [Sequential segments]) and checkpoints it there; groups never span
    # the ranks.
    def run(s):
        res = ranks(SEQ, 2, args=(json.dumps({"strategy": s}),), timeout=120)
        return json.loads(next(l for l in res[0].stdout.splitlines()
                               if l.startswith("RESULT "))[len("RESULT "):])
    plain, ckpt = run(""), run(strategy)
    assert plain["partitions_used"] == 2, plain
    assert _same_numbers(ckpt, plain), (ckpt, plain)
    assert ckpt["calls"] == 2 * plain["calls"], (ckpt, plain)
