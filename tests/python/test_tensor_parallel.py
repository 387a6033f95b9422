"""Tensor parallelism's layout (issue 41, first part): config 'tensor_parallel_degree'
splits each stage's ranks into tp groups, as SMP v1.6+ does (Note [Groups under tensor
parallelism] in smp_core/topology.cpp). Without distributed modules the tp ranks of a
stage are replicas of its parameters, reduced over the dp group (tp x rdp), so a
tp=2 x pp=2 job trains as one process on both tp ranks' batches.
"""
import json

from tp_reference import case_outputs, one_job

TOPOLOGY = r"""
import copy, json, sys
import torch, torch.nn as nn
import smp

smp.init({"partitions": 2, "microbatches": 2, "ddp": True, "tensor_parallel_degree": 2,
          "placement_strategy": sys.argv[1], "timeout_s": 60})
me = smp.rank()
out = {"rank": me, "pp": smp.pp_rank(), "tp": smp.tp_rank(), "rdp": smp.rdp_rank(),
       "dp": smp.dp_rank(), "mp": smp.mp_rank(),
       "sizes": [smp.pp_size(), smp.tp_size(), smp.rdp_size(), smp.dp_size(), smp.mp_size()],
       "tp_group": smp.get_tp_group(), "rdp_group": smp.get_rdp_group(),
       "dp_group": smp.get_dp_group(), "mp_group": smp.get_mp_group(),
       "pp_group": smp.get_pp_group()}
import torch.distributed as dist
for kind, get in [("tp", smp.get_tp_process_group), ("rdp", smp.get_rdp_process_group),
                  ("dp", smp.get_dp_process_group), ("mp", smp.get_mp_process_group)]:
    out[kind + "_pg"] = dist.get_process_group_ranks(get())
# smp's object collectives on the new groups.
out["tp_gathered"] = smp.allgather(me, smp.TP_GROUP)
out["mp_gathered"] = smp.allgather(me, smp.MP_GROUP)
smp.barrier(smp.TP_GROUP)
smp.barrier(smp.RDP_GROUP)
smp.broadcast(me * 10, smp.TP_GROUP)
peer = [r for r in smp.get_tp_group() if r != me][0]
out["from_tp_peer"] = smp.recv_from(peer)
smp.send(me + 100, 1 - smp.tp_rank(), smp.TP_RANK)
out["by_tp_rank"] = smp.recv_from(1 - smp.tp_rank(), smp.TP_RANK)

# Training: each rank of the dp group (tp x rdp) reads its own batch; the same model in
# one process on all of them.
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
ref = copy.deepcopy(net)
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

@smp.step
def step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

dp = smp.dp_size()
for i in range(3):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(4 * dp, 8, generator=g), torch.randn(4 * dp, 3, generator=g)
    mine = slice(4 * smp.dp_rank(), 4 * (smp.dp_rank() + 1))
    step(x[mine], y[mine])
    opt.step(); opt.zero_grad()
    loss = sum(nn.functional.mse_loss(ref(x[4 * d + 2 * m:4 * d + 2 * (m + 1)]),
                                      y[4 * d + 2 * m:4 * d + 2 * (m + 1)])
               for d in range(dp) for m in range(2)) / (2 * dp)
    loss.backward()
    ref_opt.step(); ref_opt.zero_grad()
full = model.state_dict()
out["max_diff"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
print("TP " + json.dumps(out), flush=True)
"""


def test_tp2_pp2_layout_groups_and_training_cluster_and_spread(ranks):
    # One job (tp_reference.one_job) for both placement strategies.
    res = ranks(one_job([(TOPOLOGY, ("cluster",)), (TOPOLOGY, ("spread",))]), 4, timeout=300)
    outs = [case_outputs(r.stdout, "TP") for r in res]
    assert all(len(o) == 2 and all(o) for o in outs), [r.stdout for r in res]
    _check_cluster(sorted((o[0] for o in outs), key=lambda o: o["rank"]))
    _check_spread(sorted((o[1] for o in outs), key=lambda o: o["rank"]))


def _check_cluster(reps):
    # "DPT" (cluster) on 4 ranks: tp fastest, then pp; rdp = 1 (the SMP docs' table).
    for r in reps:
        me = r["rank"]
        assert r["sizes"] == [2, 2, 1, 2, 4], r
        assert (r["pp"], r["tp"], r["rdp"]) == (me // 2, me % 2, 0), r
        assert r["tp_group"] == [me - me % 2, me - me % 2 + 1], r
        assert r["pp_group"] == [me % 2, me % 2 + 2], r
        assert r["rdp_group"] == [me] and r["mp_group"] == [0, 1, 2, 3], r
        assert r["dp_group"] == r["tp_group"] and r["dp"] == r["tp"], r
        assert r["mp"] == me, r
        for kind in ("tp", "rdp", "dp", "mp"):
            assert r[kind + "_pg"] == r[kind + "_group"], (kind, r)
        assert r["tp_gathered"] == r["tp_group"] and r["mp_gathered"] == [0, 1, 2, 3], r
        assert r["from_tp_peer"] == 10 * [q for q in r["tp_group"] if q != me][0], r
        assert r["by_tp_rank"] == 100 + [q for q in r["tp_group"] if q != me][0], r
        assert r["max_diff"] < 1e-5, r


def _check_spread(reps):
    # "TPD" (spread): rdp fastest, then pp, then tp: the tp peers are 2 ranks apart.
    for r in reps:
        me = r["rank"]
        assert (r["tp"], r["pp"]) == (me // 2, me % 2), r
        assert r["tp_group"] == [me % 2, me % 2 + 2], r
        assert r["max_diff"] < 1e-5, r


BAD = r"""
import json, sys
import smp
# Each config in turn, in one job: a refused smp.init leaves nothing to tear down.
for i, cfg in enumerate(json.loads(sys.argv[1])):
    try:
        smp.init(cfg)
    except smp.ConfigError as e:
        print("ERROR", i, e, flush=True)
        continue
    print("NO ERROR", i, flush=True)
    smp.shutdown()
"""


def _by_config(stdout):
    got = {}
    for line in stdout.splitlines():
        words = line.split()
        if words[:1] == ["ERROR"]:
            got[int(words[1])] = line
        elif words[:2] == ["NO", "ERROR"]:
            got[int(words[2])] = line
    return got


def test_tp_that_does_not_divide_or_lacks_ddp_is_refused_on_every_rank(ranks):
    cases = [({"tensor_parallel_degree": 3, "ddp": True},
              "config 'tensor_parallel_degree'=3 does not divide the world size 2 / "
              "'partitions'=1 = 2 (allowed: a divisor of 2)"),
             ({"tensor_parallel_degree": 2},
              "config 'ddp'=false is not allowed with 'tensor_parallel_degree'=2")]
    for r in ranks(BAD, 2, args=(json.dumps([c for c, _ in cases]),), timeout=60):
        got = _by_config(r.stdout)
        for i, (cfg, needle) in enumerate(cases):
            assert got.get(i, "").startswith("ERROR") and needle in got[i], \
                (cfg, r.stdout, r.stderr[-2000:])


def test_tp_group_across_hosts_against_cluster_placement_is_refused_on_every_rank(ranks):
    # SMP_FAKE_HOSTS=3: ranks 0-2 are one host, rank 3 another (Note [Hosts of a group]),
    # so "cluster"'s tp group [2, 3] would cross hosts; "spread" asks for that.
    cfg = {"tensor_parallel_degree": 2, "ddp": True}
    env = {"SMP_FAKE_HOSTS": "3"}
    cfgs = [cfg, dict(cfg, placement_strategy="spread")]
    for r in ranks(BAD, 4, args=(json.dumps(cfgs),), timeout=60, env=env):
        got = _by_config(r.stdout)
        assert got.get(0, "").startswith("ERROR"), (r.stdout, r.stderr[-2000:])
        assert ("config 'placement_strategy'='cluster' keeps each tp group on one host, but "
                "with 'tensor_parallel_degree'=2 tp group [2, 3] spans 2 hosts") in got[0]
        assert "'placement_strategy'='spread'" in got[0]
        assert got.get(1, "").startswith("NO ERROR"), (r.stdout, r.stderr[-2000:])
