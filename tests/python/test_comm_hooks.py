"""Comm hooks and their groups (smp.ddp_comm_hooks, docs/reducer.md "Comm hooks").

- torch's own hooks (allreduce_hook, fp16_compress_hook, PowerSGD with
  process_group=None) on an smp model at pp=2 x dp=2 reduce over the dp group: equal
  to the plain module trained in one process on the full batch; PowerSGD's compressed
  phase equals smp's own C++ PowerSGD in the same layout, and the replicas agree;
  smp's post_localSGD_hook with a default subgroup (each node's part of the dp group).
- A hook state naming a group other than the dp group raises on every rank.
- smp's built-ins on torch's DistributedDataParallel: allreduce/fp16 bit-identical to
  torch's; PowerSGD with 4 buckets on Gloo for 20 compressed steps without an abort,
  bit-identical to torch's hook made safe (each bucket's chain awaited before the
  next); bf16 and quantization hooks (1 and 4 buckets) bit-identical to torch 2.x's own
  (under 1.13, which cannot run them on Gloo, quantization against torch's arithmetic:
  its functions on CPU, .cuda() made a no-op, its misread allgather result fixed; see
  torch_peer.py); DDPCommHookType/register_ddp_comm_hook and post_localSGD against torch's.
"""
import json

import pytest
import torch

NET = r"""
import copy, json, sys
import torch, torch.nn as nn, torch.distributed as dist
from nets import Net  # tests/python/nets.py
"""

# --- torch's hooks on an smp model at pp=2 x dp=2 -------------------------------------

PP2 = NET + r"""
import smp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as th, powerSGD_hook as tps
from smp.ddp_comm_hooks import powerSGD_hook as sps

hook_name, out = sys.argv[1], sys.argv[2]
smp.init({"partitions": 2, "ddp": True, "timeout_s": 60})
rank, dp, dp_size = smp.rank(), smp.dp_rank(), smp.dp_size()
torch.manual_seed(0)
base = Net()
plain = copy.deepcopy(base)
plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
src = copy.deepcopy(base)
opt = smp.DistributedOptimizer(torch.optim.SGD(src.parameters(), lr=0.1))
model = smp.DistributedModel(src, bucket_cap_mb=0.0006)  # 2 buckets per partition
START = 3  # PowerSGD: steps 0-2 plain allreduce, 3-5 compressed
kw = dict(start_powerSGD_iter=START, random_seed=5, matrix_approximation_rank=2)
if hook_name == "allreduce":
    model.register_comm_hook(None, th.allreduce_hook)
elif hook_name == "fp16":
    model.register_comm_hook(None, th.fp16_compress_hook)
elif hook_name == "post_localSGD":
    from smp.ddp_comm_hooks import post_localSGD_hook as sls
    # Global (dp) averaging for 3 steps, then within each node's part of the dp group:
    # here the whole dp group (one host), so the plain module is the reference throughout.
    state = sls.PostLocalSGDState(None, None, start_localSGD_iter=3)
    model.register_comm_hook(state, sls.post_localSGD_hook)
    assert state.process_group is smp.get_dp_process_group()
    assert sorted(dist.get_process_group_ranks(state.subgroup)) == smp.get_dp_group()
elif hook_name == "torch_psgd":
    state = tps.PowerSGDState(process_group=None, **kw)
    model.register_comm_hook(state, tps.powerSGD_hook)
    assert state.process_group is smp.get_dp_process_group()
else:
    state = sps.PowerSGDState(process_group=None, **kw)
    model.register_comm_hook(state, sps.powerSGD_hook)

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

def batch(step, d):
    g = torch.Generator().manual_seed(1000 * step + d)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)

def check_plain(tol):
    ref = dict(plain.named_parameters())
    for name, p in model.local_named_parameters():
        torch.testing.assert_close(p, ref[name], rtol=tol, atol=tol,
                                   msg=lambda m: f"rank {rank} {name}: {m}")

steps = 6
for step in range(steps):
    train_step(*batch(step, dp))
    opt.step(); opt.zero_grad()
    full = [batch(step, d) for d in range(dp_size)]
    nn.functional.mse_loss(plain(torch.cat([x for x, _ in full])),
                           torch.cat([y for _, y in full])).backward()
    plain_opt.step(); plain_opt.zero_grad()
    if hook_name in ("allreduce", "fp16", "post_localSGD") or step == START - 1:
        check_plain(1e-3 if hook_name == "fp16" else 1e-5)
assert len(model._reducer.bucket_indices()) >= 2, model._reducer.bucket_indices()
torch.save({n: p.detach() for n, p in model.local_named_parameters()}, f"{out}.{rank}")
print("ok", hook_name)
"""


@pytest.mark.parametrize("hook", ["allreduce", "fp16", "post_localSGD"])
def test_torch_default_hooks_at_pp2_dp2_match_plain_module(ranks, tmp_path, hook):
    ranks(PP2, 4, args=(hook, str(tmp_path / hook)))


def test_torch_powersgd_none_group_at_pp2_dp2(ranks, tmp_path):
    # Plain-allreduce phase: checked against the plain module inside the script.
    # Compressed phase: torch's hook (Python, on smp's comm thread) against smp's C++
    # PowerSGD on the same buckets and seed (parity with torch's tested in
    # test_powersgd.py); and the two replicas of each partition agree exactly.
    ranks(PP2, 4, args=("torch_psgd", str(tmp_path / "t")))
    ranks(PP2, 4, args=("smp_psgd", str(tmp_path / "s")))
    for rank in range(4):
        t = torch.load(tmp_path / f"t.{rank}")
        s = torch.load(tmp_path / f"s.{rank}")
        assert t.keys() == s.keys() and t
        for name in t:
            torch.testing.assert_close(t[name], s[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        replica = torch.load(tmp_path / f"t.{rank ^ 2}")  # dp groups {0, 2} and {1, 3}
        for name in t:
            assert torch.equal(t[name], replica[name]), (rank, name)


BAD_GROUP = NET + r"""
import smp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as th, powerSGD_hook as tps

smp.init({"partitions": 2, "ddp": True, "timeout_s": 60})
rank = smp.rank()
evens = dist.new_group([0, 2])  # rank 0's and 2's dp group; ranks 1 and 3 are not in it
model = smp.DistributedModel(Net())
for state in (dist.group.WORLD, tps.PowerSGDState(process_group=dist.group.WORLD), evens):
    try:
        model.register_comm_hook(state, th.allreduce_hook if not hasattr(state, "iter")
                                 else tps.powerSGD_hook)
    except smp.ConfigError as e:
        print("RAISED", str(e), flush=True)
    else:
        raise AssertionError(f"rank {rank}: {state} was accepted")
print("done")
"""


def test_explicit_non_dp_group_raises_on_every_rank(ranks):
    res = ranks(BAD_GROUP, 4)
    for r in res:
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RAISED")]
        assert len(lines) == 3, r
        dp = [[0, 2], [1, 3]][r.rank % 2]
        assert lines[0] == (
            "RAISED smp: register_comm_hook: the hook state is a process group of ranks "
            f"[0, 1, 2, 3], but a comm hook on an smp model reduces over the model's dp group "
            f"(ranks {dp}); pass None (or smp.get_dp_process_group()) to reduce over it"), lines
        assert "the state's process_group is a process group of ranks [0, 1, 2, 3]" in lines[1]
        # The group [0, 2] is rank 0's and 2's dp group, but not 1's and 3's: all raise,
        # ranks 0 and 2 with rank 1's message.
        if r.rank % 2:
            assert "process group of unknown ranks" in lines[2], lines[2]
            assert lines[2].endswith("to reduce over it"), lines[2]
        else:
            assert lines[2].endswith("(rank 1)"), lines[2]


# --- smp's built-ins on torch's DistributedDataParallel -------------------------------

ON_TORCH_DDP = NET + r"""
import numpy as np
from torch.nn.parallel import DistributedDataParallel as DDP
import torch.distributed.algorithms.ddp_comm_hooks as thc
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks as th, powerSGD_hook as tps, quantization_hooks as tq,
    post_localSGD_hook as tls)
import smp
import smp.ddp_comm_hooks as shc
from smp.ddp_comm_hooks import (
    default_hooks as sh, powerSGD_hook as sps, quantization_hooks as sq,
    post_localSGD_hook as sls)
from torch_peer import BF16_ON_GLOO, QUANTIZATION_HOOKS_RUN_ON_GLOO, quantization_helper

smp.init({"ddp": True, "timeout_s": 60})
rank = dist.get_rank()
torch.manual_seed(0)
base = Net()

def train(register, cap=25, steps=4):
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(cap * 1024 * 1024)  # torch's knob: no 1 MiB first
    m = DDP(copy.deepcopy(base), bucket_cap_mb=cap)
    register(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        nn.functional.mse_loss(m(x), y).backward()
        opt.step(); opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]

SMALL = 0.0006  # 629 bytes: 4 buckets once torch rebuilt them in gradient order

def hooked(state, hook):
    return lambda m: m.register_comm_hook(state, hook)

def same(what, a, b):
    for i, (p, q) in enumerate(zip(a, b)):
        assert torch.equal(p, q), f"{what}: parameter {i} differs by {(p - q).abs().max()}"
    print("equal", what, flush=True)

def awaited(hook):
    # torch's hook made safe on Gloo: each bucket's chain completes before the next.
    def run(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut
    return run

# allreduce / fp16: bit-identical.
same("allreduce", train(hooked(None, th.allreduce_hook)), train(hooked(None, sh.allreduce_hook)))
same("fp16", train(hooked(None, th.fp16_compress_hook)), train(hooked(None, sh.fp16_compress_hook)))
same("fp16_wrapper", train(hooked(None, th.fp16_compress_wrapper(th.allreduce_hook))),
     train(hooked(None, sh.fp16_compress_wrapper(sh.allreduce_hook))))

# PowerSGD, 4 buckets, 20 compressed steps: no abort, bit-identical to torch's awaited.
kw = dict(start_powerSGD_iter=2, random_seed=3, matrix_approximation_rank=2)
buckets = set()
def counting(hook):
    def run(state, bucket):
        buckets.add(bucket.index())
        return hook(state, bucket)
    return run
ours_state, torch_state = sps.PowerSGDState(None, **kw), tps.PowerSGDState(None, **kw)
ours = train(hooked(ours_state, counting(sps.powerSGD_hook)), cap=SMALL, steps=22)
assert len(buckets) == 4, buckets
same("powerSGD 4 buckets", ours,
     train(hooked(torch_state, awaited(tps.powerSGD_hook)), cap=SMALL, steps=22))
# The states hold the same: smp's state_dict() has torch's pickled fields (no process
# group), the same values (smp's own pickle holds them as plain data: Note [Hook state
# loads weights-only]).
mine, theirs = ours_state.state_dict(), torch_state.__getstate__()
assert "process_group" not in mine and set(theirs) <= set(mine), (set(theirs) - set(mine))
for key, value in theirs.items():
    if key == "rng":
        assert all(np.array_equal(a, b) for a, b in zip(value.get_state(), mine[key].get_state()))
    elif isinstance(value, dict):
        assert value.keys() == mine[key].keys() and all(
            torch.equal(value[b], mine[key][b]) for b in value), key
    else:
        assert value == mine[key], (key, value, mine[key])
# Plain-allreduce phase: 4 buckets equal torch's hook with one bucket.
kw1000 = dict(kw, start_powerSGD_iter=1000)
same("powerSGD vanilla 4 vs 1 bucket",
     train(hooked(sps.PowerSGDState(None, **kw1000), sps.powerSGD_hook), cap=SMALL),
     train(hooked(tps.PowerSGDState(None, **kw1000), tps.powerSGD_hook)))
same("batched_powerSGD 4 buckets",
     train(hooked(sps.PowerSGDState(None, **kw), sps.batched_powerSGD_hook), cap=SMALL, steps=6),
     train(hooked(sps.PowerSGDState(None, **kw), awaited(sps.batched_powerSGD_hook)), cap=SMALL,
           steps=6))

# bf16 (Gloo reduces bfloat16 since torch 2.x): bit-identical to torch's.
if BF16_ON_GLOO:
    same("bf16", train(hooked(None, th.bf16_compress_hook)),
         train(hooked(None, sh.bf16_compress_hook)))
    same("bf16_wrapper", train(hooked(None, th.bf16_compress_wrapper(th.allreduce_hook))),
         train(hooked(None, sh.bf16_compress_wrapper(sh.allreduce_hook))))

# Quantization. torch 2.x's hooks run here: smp's against them, one bucket as they are
# and 4 buckets awaited (their second allgather comes from a future callback, see
# torch_peer.py). torch 1.13's cannot: they call .cuda(), and they index the allgather's
# result as one stacked tensor where Gloo gives a list of tensors ("invalid index of a
# 0-dim tensor"); there the reference composes torch's own observers and
# quantize/dequantize functions as their docstrings describe, synchronously.
if not QUANTIZATION_HOOKS_RUN_ON_GLOO:
    torch.Tensor.cuda = lambda self, *a, **k: self  # torch's helpers call .cuda(device)
    nn.Module.cuda = lambda self, *a, **k: self

def ref_quantization(per_channel, bucket_size=512):
    def hook(pg, bucket):
        group = pg if pg is not None else dist.group.WORLD
        world, me = group.size(), dist.get_rank(group)
        t = bucket.buffer()
        if per_channel:
            t = nn.functional.pad(t, (0, bucket_size - len(t) % bucket_size)).view(-1, bucket_size)
            obs = torch.quantization.PerChannelMinMaxObserver()
        else:
            obs = torch.quantization.MinMaxObserver()
        obs(t)
        s, z = obs.calculate_qparams()
        sz = torch.stack((s, z)) if per_channel else torch.FloatTensor([s, z])
        all_sz = [torch.zeros_like(sz) for _ in range(world)]
        dist.all_gather(all_sz, sz, group=group)
        kind = "per_channel" if per_channel else "per_tensor"
        quant = quantization_helper(tq, "quantize", kind)
        deq = quantization_helper(tq, "dequantize", kind)
        q = quant(t, all_sz[me][0], all_sz[me][1])
        all_q = [torch.zeros_like(q) for _ in range(world)]
        dist.all_gather(all_q, q, group=group)
        agg = torch.zeros_like(all_q[0], dtype=torch.float32)
        for k, qk in enumerate(all_q):
            agg += deq(qk, all_sz[k][0], all_sz[k][1])
        if per_channel:
            agg = torch.flatten(agg)[:bucket.buffer().numel()]
        fut = torch.futures.Future()
        fut.set_result(agg / world)
        return fut
    return hook

def perchannel_7(process_group, bucket):  # torch's DDP wants a __name__: no partial
    return sq.quantization_perchannel_hook(process_group, bucket, bucket_size=7)

if QUANTIZATION_HOOKS_RUN_ON_GLOO:
    def torch_perchannel_7(process_group, bucket):
        return tq.quantization_perchannel_hook(process_group, bucket, bucket_size=7)
    peer = {"pertensor": tq.quantization_pertensor_hook,
            "perchannel": tq.quantization_perchannel_hook, "perchannel_7": torch_perchannel_7}
else:
    peer = {"pertensor": ref_quantization(False), "perchannel": ref_quantization(True),
            "perchannel_7": ref_quantization(True, 7)}
same("quantization_pertensor", train(hooked(None, peer["pertensor"])),
     train(hooked(None, sq.quantization_pertensor_hook)))
same("quantization_perchannel", train(hooked(None, peer["perchannel"])),
     train(hooked(None, sq.quantization_perchannel_hook)))
same("quantization_pertensor 4 buckets",
     train(hooked(None, awaited(peer["pertensor"])), cap=SMALL),
     train(hooked(None, sq.quantization_pertensor_hook), cap=SMALL))
same("quantization_perchannel 4 buckets, bucket_size 7",
     train(hooked(None, awaited(peer["perchannel_7"])), cap=SMALL),
     train(hooked(None, perchannel_7), cap=SMALL))

# DDPCommHookType / register_ddp_comm_hook against torch's (its batched PowerSGD fails
# on CPU in 1.13 and 2.15, and is left out; bf16 and quantization where torch_peer.py
# says torch's run here, else quantization against the reference).
assert [t.name for t in shc.DDPCommHookType] == [t.name for t in thc.DDPCommHookType]
names = ["ALLREDUCE", "FP16_COMPRESS", "POWER_SGD", "POWER_SGD_RANK2", "NOOP"]
names += ["BF16_COMPRESS"] if BF16_ON_GLOO else []
names += ["QUANTIZE_PER_TENSOR", "QUANTIZE_PER_CHANNEL"] if QUANTIZATION_HOOKS_RUN_ON_GLOO else []
for name in names:
    same(f"DDPCommHookType.{name}",
         train(lambda m: thc.register_ddp_comm_hook(thc.DDPCommHookType[name], m, None)),
         train(lambda m: shc.register_ddp_comm_hook(shc.DDPCommHookType[name], m, None)))
if not QUANTIZATION_HOOKS_RUN_ON_GLOO:
    for name, per_channel in (("QUANTIZE_PER_TENSOR", False), ("QUANTIZE_PER_CHANNEL", True)):
        same(f"DDPCommHookType.{name}", train(hooked(None, ref_quantization(per_channel))),
             train(lambda m: shc.register_ddp_comm_hook(shc.DDPCommHookType[name], m)))
try:
    shc.register_ddp_comm_hook("ALLREDUCE", None)
except ValueError as e:
    assert "comm_hook_type='ALLREDUCE' is not one of {ALLREDUCE, FP16_COMPRESS" in str(e), e
else:
    raise AssertionError("a string was accepted as comm_hook_type")

# post-local SGD: global allreduce for 2 steps, then within each subgroup (one rank
# each here), or none at all; against torch's with the same subgroups.
solo = [dist.new_group([r]) for r in range(2)][rank]
for post in (True, False):
    st = sls.PostLocalSGDState(None, solo, 2, post_local_gradient_allreduce=post)
    same(f"post_localSGD post_local_gradient_allreduce={post}",
         train(hooked(tls.PostLocalSGDState(None, solo, 2, post), tls.post_localSGD_hook)),
         train(hooked(st, sls.post_localSGD_hook)))
    assert st.iter == 2
# The default subgroup: this node's ranks (both), made when the state is built.
st = sls.PostLocalSGDState(None, None, 1)
assert sorted(dist.get_process_group_ranks(st.subgroup)) == [0, 1]
same("post_localSGD node subgroup", train(hooked(st, sls.post_localSGD_hook)),
     train(hooked(None, th.allreduce_hook)))

# A group with the dp group's members (the world, at pp=1) is taken as the dp group.
model = smp.DistributedModel(Net())
model.register_comm_hook(dist.group.WORLD, th.allreduce_hook)
assert model._comm_hook[0] is smp.get_dp_process_group()

# A hook that fails on the comm queue (a state from another model) raises from
# backward on every rank, naming it; the buckets queued behind it fail too, no hang.
# Last: the world group's queue stays failed in this process (its order is lost).
small = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))
m = DDP(small, bucket_cap_mb=SMALL)
m.register_comm_hook(ours_state, sps.powerSGD_hook)
try:
    m(torch.randn(4, 8)).sum().backward()
except RuntimeError as e:
    assert "smp: powerSGD: the state's error_dict[0] holds 164 elements but bucket 0 " \
           "needs 484 (state from a different model or bucket layout)" in str(e), e
else:
    raise AssertionError("a state of another model was accepted")
print("all ok")
"""


def test_smp_hooks_on_torch_ddp(ranks):
    res = ranks(ON_TORCH_DDP, 2)
    assert all("all ok" in r.stdout for r in res)
    print(res[0].stdout)
