"""Optimizer-state sharding (config "shard_optimizer_state": true; Note [Sharded optimizer
state] in smp/optimizer_sharding.py): each dp rank keeps and steps the optimizer state of
its share of the parameters, and the results equal the unsharded run's.
"""
import json

import pytest

TRAIN = r"""
import hashlib, json, sys
import torch, torch.nn as nn
import smp

opts = json.loads(sys.argv[1])
smp.init(dict(opts["cfg"], microbatches=2))
torch.manual_seed(0)
if opts.get("tied"):  # the first and the last but one layer share a weight
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 64), nn.ReLU(),
                        nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 8))
    net[6].weight = net[0].weight
else:
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
model = smp.DistributedModel(net, bucket_cap_mb=opts.get("cap_mb", 25))
make = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}[opts["opt"]]
opt = smp.DistributedOptimizer(make(net.parameters()))
if opts.get("load"):
    saved = torch.load(opts["load"], weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
if opts.get("resume"):  # SMP's partial checkpoint, written at another dp size
    smp.resume_from_checkpoint(opts["resume"])


@smp.step
def train(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss


per = 16 // smp.dp_size()  # the same global batch at every dp size
for step in range(opts.get("first", 0), opts["steps"]):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g)
    lo = smp.dp_rank() * per
    train(x[lo:lo + per], y[lo:lo + per])
    if opts.get("torch_clip"):  # Note [torch's clip on the whole model]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    else:
        model.clip_grad_norm_(1.0)
    opt.step()
    if step + 1 < opts["steps"]:
        opt.zero_grad()
if opts.get("checkpoint"):
    smp.save_checkpoint(opts["checkpoint"], "t", partial=True, model=model, optimizer=opt)
full_opt = opt.state_dict()  # every rank's share, gathered (collective)
state = model.state_dict()
if opts.get("save") and smp.rank() == 0:
    torch.save({"model": state, "optimizer": full_opt}, opts["save"])
held = sum(t.numel() for s in opt.state.values() for t in s.values()
           if torch.is_tensor(t) and t.dim() > 0)
held_by_pp = smp.allgather(held, smp.DP_GROUP)
grads = smp.allgather(sum(p.grad.numel() for p in model.local_parameters()
                          if p.grad is not None), smp.DP_GROUP)
if smp.dp_rank() == 0:
    out = dict(pp=smp.pp_rank(), held=held_by_pp, grads=grads,
               params={k: v.tolist() for k, v in state.items()},
               opt={str(k): {n: t.tolist() for n, t in s.items()}
                    for k, s in full_opt["state"].items()})
    print("RESULT " + json.dumps(out))
smp.shutdown()
"""


def _results(stdouts):
    out = []
    for text in stdouts:
        for line in text.splitlines():
            if line.startswith("RESULT "):
                out.append(json.loads(line[len("RESULT "):]))
    return sorted(out, key=lambda d: d["pp"])


def _run(ranks, world, cfg, opt, steps=3, env=None, **extra):
    opts = dict(cfg=cfg, opt=opt, steps=steps, **extra)
    res = ranks(TRAIN, world, args=(json.dumps(opts),), timeout=120, env=env)
    return _results(r.stdout for r in res)


def _run_in_one_job(tmp_path, world, runs):
    """Each of `runs` ((cfg, opt, steps, extra) in turn) as _run gives it, all in one job
    (Note [One job for many cases] in conftest.py): each inits smp with its config."""
    from conftest import run_cases
    job = run_cases(TRAIN, [(json.dumps(dict(cfg=cfg, opt=opt, steps=steps, **extra)),)
                            for cfg, opt, steps, extra in runs], world, tmp_path,
                    timeout_per_case=120)
    return [_results(job.stdout(i)) for i in range(len(runs))]


def _close(got, want, what):
    import torch
    if isinstance(want, dict):
        assert got.keys() == want.keys(), what
        for k in want:
            _close(got[k], want[k], f"{what}.{k}")
    else:
        assert torch.allclose(torch.tensor(got, dtype=torch.float64),
                              torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6), what


# Each optimizer and each layout once (SGD's multi-round exchange at dp=4, AdamW's
# global-norm clip across the pipeline), to keep the suite inside its budget.
@pytest.mark.parametrize("cfg,opt", [({"partitions": 1}, "sgd"), ({"partitions": 2}, "adamw")],
                         ids=["pp1xdp4-sgd", "pp2xdp2-adamw"])
def test_sharded_equals_unsharded(ranks, cfg, opt):
    # To 1e-6, not bitwise: each gradient is summed by its owner (Note [Reduce to
    # owner]), and the clipping norm over every rank, in another order.
    # With SGD, buckets of 8 KiB: each rank's share is stepped and sent in several
    # rounds, each in flight while the next is stepped (ShareExchange). With AdamW the
    # sharded run clips with torch.nn.utils.clip_grad_norm_(model.parameters()), which
    # on a DistributedModel clips by the global norm (Note [torch's clip on the whole
    # model]) like the unsharded run's model.clip_grad_norm_.
    cfg = dict(cfg, ddp=True)
    extra = {"cap_mb": 1 / 128} if opt == "sgd" else {}
    plain = _run(ranks, 4, cfg, opt, **extra)
    sharded = _run(ranks, 4, dict(cfg, shard_optimizer_state=True), opt,
                   torch_clip=opt == "adamw", **extra)
    for p, s in zip(plain, sharded):
        _close(s["params"], p["params"], "params")
        _close(s["opt"], p["opt"], "optimizer state")  # the gathered state is the unsharded one
        # Each dp rank holds a part of its pp rank's state, and of its gradients after
        # the step; together, all of it.
        assert sum(s["held"]) == p["held"][0]
        assert max(s["held"]) < p["held"][0]
        assert sum(s["grads"]) == p["grads"][0], (s["grads"], p["grads"])
        assert max(s["grads"]) < p["grads"][0]


def test_sharded_tied_weights_across_partitions_equal_unsharded(ranks):
    # A weight tied across the pp ranks is summed across its holders after the step:
    # every dp rank keeps its gradient (Note [Reduce to owner]).
    cfg = {"ddp": True, "partitions": 2}
    plain = _run(ranks, 4, cfg, "adamw", tied=True)
    sharded = _run(ranks, 4, dict(cfg, shard_optimizer_state=True), "adamw", tied=True)
    assert len(plain) == 2 and any(k.startswith("0.") for k in plain[1]["params"]), \
        "the tied weight is held by both pp ranks"
    for p, s in zip(plain, sharded):
        _close(s["params"], p["params"], "params")
        _close(s["opt"], p["opt"], "optimizer state")


def test_sharded_through_the_process_group_equals_shared_memory(ranks):
    # The reduction to owners by c10d reduce (ranks on several hosts) and in shared memory.
    cfg = {"ddp": True, "partitions": 2, "shard_optimizer_state": True}
    shm = _run(ranks, 4, cfg, "adamw")
    gloo = _run(ranks, 4, cfg, "adamw", env={"SMP_REDUCER_SHM": "0"})
    for a, b in zip(shm, gloo):
        _close(b["params"], a["params"], "params")
        assert b["grads"] == a["grads"]


def test_the_full_state_reshards_to_another_dp_size(tmp_path):
    # Two steps sharded at dp=2, the gathered state saved, then the third step at dp=4
    # sharded and at pp=2 x dp=2 equals three unsharded steps at dp=2 (to rounding: the
    # mean over 4 ranks sums in another order).
    path = str(tmp_path / "ckpt.pt")
    want = _run_in_one_job(tmp_path, 2, [
        ({"ddp": True}, "adamw", 3, {}),
        ({"ddp": True, "shard_optimizer_state": True}, "adamw", 2, {"save": path})])[0][0]
    for got in _run_in_one_job(tmp_path, 4, [
            (dict(cfg, shard_optimizer_state=True), "adamw", 3, {"first": 2, "load": path})
            for cfg in ({"ddp": True}, {"ddp": True, "partitions": 2})]):
        params = {}
        for part in got:
            params.update(part["params"])
        import torch
        for k, v in want["params"].items():
            assert torch.allclose(torch.tensor(params[k]), torch.tensor(v), atol=1e-6), k


@pytest.fixture(scope="module")
def sgd_sharded_checkpoint(tmp_path_factory):
    """(three unsharded SGD steps at dp=2, the directory of a partial checkpoint saved
    after two sharded steps at dp=2): both runs in one job, once for the module."""
    tmp = tmp_path_factory.mktemp("sgd_sharded")
    d = str(tmp / "ckpt")
    want, _ = _run_in_one_job(tmp, 2, [
        ({"ddp": True}, "sgd", 3, {}),
        ({"ddp": True, "shard_optimizer_state": True}, "sgd", 2, {"checkpoint": d})])
    return want[0], d


@pytest.mark.parametrize("world,cfg", [
    (1, {}), (4, {"shard_optimizer_state": True}),
    (4, {"partitions": 2, "shard_optimizer_state": True}),
], ids=["dp1", "dp4-sharded", "pp2xdp2-sharded"])
def test_a_sharded_partial_checkpoint_resumes_at_another_layout(ranks, tmp_path, world, cfg,
                                                                sgd_sharded_checkpoint):
    # save_checkpoint(partial=True) of a sharded optimizer: each rank writes its share
    # (smp.save(..., v3=True)); any layout reads them back, each rank its round of files
    # and the entries exchanged by name. Each layout resumes its own copy of the save.
    import os
    import shutil
    want, saved = sgd_sharded_checkpoint
    d = str(tmp_path / "ckpt")
    shutil.copytree(saved, d)
    files = sorted(os.listdir(os.path.join(d, "t_partial")))
    assert "optimizer_0_0" in files and "optimizer_0_1" in files, files  # a share each
    assert "optimizer_0" not in files, files                            # nothing gathered
    got = _run(ranks, world, dict(cfg, ddp=True), "sgd", steps=3, first=2, resume=d)
    params = {}
    for part in got:
        params.update(part["params"])
    import torch
    for k, v in want["params"].items():
        assert torch.allclose(torch.tensor(params[k]), torch.tensor(v), atol=1e-6), k


BAD = r"""
import sys
import torch, torch.nn as nn
import smp
smp.init({"ddp": True, "shard_optimizer_state": True})
net = nn.Linear(4, 4)
model = smp.DistributedModel(net)
try:
    if sys.argv[1] == "powersgd":
        from smp.ddp_comm_hooks import powerSGD_hook as powerSGD
        model.register_comm_hook(powerSGD.PowerSGDState(None), powerSGD.powerSGD_hook)
    elif sys.argv[1] == "lbfgs":
        opt = smp.DistributedOptimizer(torch.optim.LBFGS(net.parameters()))
        @smp.step
        def run(x):
            return model(x)
        run(torch.ones(2, 4))
    else:
        with model.join():
            pass
except smp.ConfigError as e:
    print("ERROR", e)
smp.shutdown()
"""


@pytest.mark.parametrize("case,text", [
    ("lbfgs", "smp: config 'shard_optimizer_state'=true cannot shard LBFGS, whose step "
              "couples every parameter"),
    ("powersgd", "smp: register_comm_hook(hook=powerSGD_hook): with optimizer-state "
                 "sharding (config 'shard_optimizer_state'=true) each gradient is reduced "
                 "to the one rank that steps it"),
    ("join", "smp.join.Join: config 'shard_optimizer_state'=true is not supported with "
             "uneven inputs (Join) yet"),
])
def test_what_cannot_shard_is_named_on_every_rank(ranks, case, text):
    for r in ranks(BAD, 2, args=(case,), timeout=60):
        assert r.returncode == 0, r
        assert text in r.stdout, r
