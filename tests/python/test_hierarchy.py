"""The hierarchical reduction (Note [Hierarchical reduction], smp_core/detail/host_links.cpp)
on one machine: SMP_FAKE_HOSTS=2 makes 4 ranks count as 2 hosts of 2 ranks (Note [Hosts
of a group]), so the dp group sums in shared memory within each "host" and over Gloo
between them. Each job trains 4 SGD steps at dp=4 with different data per rank and also
trains the plain module on the whole batch in-process, so it checks itself against one
process; the tests compare the jobs with each other:

- the default reduction: hierarchical equals the flat path (Gloo across the "hosts")
  within 1e-6, and one process within 1e-5; the decision is logged once;
- optimizer-state sharding (reduce to owner, across hosts);
- PowerSGD (smp's C++ hook) and torch's own Python allreduce hook, which run on the hosts'
  first ranks over the hosts group: equal to the same hook flat (PowerSGD is linear in
  its input, so compressing the hosts' means equals compressing every rank's gradient).
The same arithmetic across real namespaces, bitwise: tests/hosts/test_hosts.py.
"""
import json

import pytest

TRAIN = r"""
import copy, json, sys
import torch, torch.nn as nn
import smp
from nets import Net  # tests/python/nets.py

opts = json.loads(sys.argv[1])
cfg = {"ddp": True}
if opts.get("shard"):
    cfg["shard_optimizer_state"] = True
smp.init(cfg)
torch.manual_seed(0)
base = Net()
ref = copy.deepcopy(base)
model = smp.DistributedModel(copy.deepcopy(base), bucket_cap_mb=opts.get("cap", 0.002))
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
hook = opts.get("hook")
if hook == "powersgd":
    from smp.ddp_comm_hooks import powerSGD_hook as psgd
    model.register_comm_hook(psgd.PowerSGDState(None, matrix_approximation_rank=2,
                                                start_powerSGD_iter=2, min_compression_rate=1),
                             psgd.powerSGD_hook)
elif hook == "torch_allreduce":
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as th
    model.register_comm_hook(None, th.allreduce_hook)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)


@smp.step
def train(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss


per, world = 8, smp.dp_size()
for step in range(4):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(per * world, 8, generator=g), torch.randn(per * world, 4, generator=g)
    lo = smp.dp_rank() * per
    train(x[lo:lo + per], y[lo:lo + per])
    opt.step()
    opt.zero_grad()
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
red = model._reducer
state = {k: v.clone() for k, v in model.state_dict().items()}
everyone = smp.allgather(state, smp.DP_GROUP)
for other in everyone[1:]:  # replicas are bitwise equal
    for k in state:
        assert torch.equal(other[k], state[k]), k
worst = max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items())
if hook is None:  # a compressing hook is not the plain module's arithmetic
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5)
if smp.rank() == 0:
    torch.save(state, opts["out"])
    print("RESULT " + json.dumps({"hierarchy": red.hierarchy(), "buckets": len(red.bucket_indices()),
                                  "vs_one_process": worst}))
smp.shutdown()
"""


def _job(ranks, tmp_path, name, hierarchical, **opts):
    import torch
    out = tmp_path / f"{name}.pt"
    env = {"SMP_FAKE_HOSTS": "2", "SMP_REDUCER_HIERARCHY": "1" if hierarchical else "0"}
    res = ranks(TRAIN, 4, env=env, args=(json.dumps(dict(opts, out=str(out))),))
    line = [ln for ln in res[0].stdout.splitlines() if ln.startswith("RESULT ")][0]
    info = json.loads(line[len("RESULT "):])
    assert info["buckets"] >= 2, info
    if hierarchical:
        assert "spans 2 hosts x 2 ranks" in info["hierarchy"], info
        said = [r.stderr.count("hierarchical reduction") for r in res]
        assert said == [1, 0, 0, 0], said  # logged once, by dp rank 0
    else:
        assert info["hierarchy"] == "", info
    return torch.load(out), info


def _close(a, b, rtol, atol):
    import torch
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


@pytest.fixture(scope="module")
def flat_default(tmp_path_factory):
    """The flat path's result (Gloo across the "hosts"), computed once for the module."""
    from conftest import assert_all_ok, run_ranks
    tmp = tmp_path_factory.mktemp("flat")

    def ranks(script, world, **kw):
        res = run_ranks(script, world, tmp, **kw)
        assert_all_ok(res)
        return res
    return _job(ranks, tmp, "flat", False)[0]


def test_default_reduction_equals_flat(ranks, tmp_path, flat_default):
    hier, info = _job(ranks, tmp_path, "hier", True)
    _close(hier, flat_default, 1e-6, 1e-6)
    print(info)


def test_sharded_optimizer_reduces_to_owner_across_hosts(ranks, tmp_path):
    _job(ranks, tmp_path, "hier", True, shard=True)  # checks itself against one process


def test_python_hook_runs_between_hosts(ranks, tmp_path, flat_default):
    # torch's own allreduce_hook, over the hosts group on the hosts' means: the default
    # reduction's numbers (to float rounding), on a group made in C++.
    hier, info = _job(ranks, tmp_path, "hier", True, hook="torch_allreduce")
    _close(hier, flat_default, 1e-6, 1e-6)


def test_powersgd_runs_between_hosts(ranks, tmp_path):
    hier, info = _job(ranks, tmp_path, "hier", True, hook="powersgd")
    flat, _ = _job(ranks, tmp_path, "flat", False, hook="powersgd")
    _close(hier, flat, 1e-4, 1e-5)
    print(info)
