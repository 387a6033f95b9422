"""Interchange with torch.distributed.checkpoint (DCP): `python -m smp.checkpoint to-dcp` /
`from-dcp` and smp.checkpoint.to_dcp / from_dcp, on real jobs (docs/checkpoint.md).

- smp -> DCP: a pp=2 job's save_checkpoint, partial and full, loads into a plain
  module and a plain Adam through dcp.load + set_optimizer_state_dict, bitwise equal to
  the job's gathered state; one more step on each side is equal too;
- smp -> DCP of a sharded optimizer's shares (shard_optimizer_state, dp=2);
- DCP -> smp: a plain process's dcp.save of {"model", "optim"} becomes a full
  save_checkpoint directory that jobs at pp=1 and pp=2 resume with
  resume_from_checkpoint(partial=False); the step after equals the plain module's; a
  DCP checkpoint written by two DDP ranks converts too;
- smp -> DCP -> smp gives back the source's model, optimizer and user content;
- the CLI's errors (a missing key, a missing directory) are one line, exit status 1.
"""
import json
import os
import subprocess
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

import smp
from conftest import PYTHON, free_port, rank_env, run_ranks

NET = r"""
import torch, torch.nn as nn

def make_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))

def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)

def plain_step(net, opt, step):
    x, y = batch(step)
    opt.zero_grad()
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()
"""
_NET = {}
exec(NET, _NET)  # the same module and data in this process  # noqa: S102
make_net, batch, plain_step = _NET["make_net"], _NET["batch"], _NET["plain_step"]

SMP_JOB = NET + r"""
import json, sys
import smp
opts = json.loads(sys.argv[1])
smp.init({"partitions": opts["pp"], "timeout_s": 60})
net = make_net()
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01))

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

def step(i):
    x, y = batch(i)
    opt.zero_grad()
    train_step(x, y)
    opt.step()

def same(got, want, what):
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for k, v in want.items():
        if isinstance(v, dict):
            same(got[k], v, f"{what}.{k}")
        else:
            assert (torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v), \
                f"{what}.{k} differs"
"""

SAVE = SMP_JOB + r"""
for i in range(3):
    step(i)
content = {"step": 3, "note": "pp2"}
smp.save_checkpoint(opts["partial_dir"], "step3", partial=True, user_content=content)
smp.save_checkpoint(opts["full_dir"], "step3", partial=False, user_content=content)
ref = {"model": model.state_dict(gather_to_rank0=True),
       "optim": opt.state_dict(gather_to_rank0=True)}
step(3)
ref_next = {"model": model.state_dict(gather_to_rank0=True),
            "optim": opt.state_dict(gather_to_rank0=True)}
if smp.rank() == 0:
    torch.save({"ref": ref, "next": ref_next}, opts["ref"])
print("SAVED", flush=True)
"""

RESUME = SMP_JOB + r"""
got = smp.resume_from_checkpoint(opts["dir"], partial=False)
assert got == {"epoch": 3}, got
plain = make_net(seed=1)
popt = torch.optim.Adam(plain.parameters(), lr=0.5)
want = torch.load(opts["plain"])
plain.load_state_dict(want["model"])
popt.load_state_dict(want["optim"])
# The step after the resume equals the plain module's next step (this process's threads).
step(3)
plain_step(plain, popt, 3)
full, osd = model.state_dict(), opt.state_dict()
same(full, plain.state_dict(), "model after the resumed step")
same(osd["state"], popt.state_dict()["state"], "optimizer state after the resumed step")
assert osd["param_groups"] == popt.state_dict()["param_groups"], osd["param_groups"]
print("RESUMED", flush=True)
"""


SHARDED = SMP_JOB.replace('"partitions": opts["pp"],',
                          '"partitions": 1, "ddp": True, "shard_optimizer_state": True,') + r"""
for i in range(3):  # each dp rank steps its share of the state
    step(i)
smp.save_checkpoint(opts["dir"], "step3", partial=True)  # optimizer_0_0, optimizer_0_1
ref = {"model": model.state_dict(), "optim": opt.state_dict()}
if smp.rank() == 0:
    torch.save(ref, opts["ref"])
"""

DDP_WRITER = NET + r"""
# torch's own multi-rank way: DDP, then every rank calls dcp.save (DCP spreads the
# replicated entries over the ranks' files).
import sys, warnings
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
net = make_net(seed=3)
model = DDP(net)
opt = torch.optim.Adam(model.parameters(), lr=0.02)
r = dist.get_rank()
for i in range(2):
    x, y = batch(i)
    opt.zero_grad()
    nn.functional.mse_loss(model(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
    opt.step()
dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
         checkpoint_id=sys.argv[1])
if r == 0:
    torch.save({"model": net.state_dict(), "optim": opt.state_dict()}, sys.argv[2])
dist.destroy_process_group()
"""


def _run(script, world, tmp_path, opts):
    res = run_ranks(script, world, tmp_path, args=(json.dumps(opts),), timeout=120)
    bad = [r for r in res if r.returncode != 0]
    assert not bad, "\n".join(map(repr, bad))


def _cli(*args):
    return subprocess.run([PYTHON, "-m", "smp.checkpoint", *map(str, args)],
                          capture_output=True, text=True, env=rank_env(0, 1, free_port()),
                          timeout=120)


def _same(got, want, what):
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for k, v in want.items():
        if isinstance(v, dict):
            _same(got[k], v, f"{what}.{k}")
        elif torch.is_tensor(v):
            assert torch.equal(got[k], v), f"{what}.{k} differs"
        else:
            assert got[k] == v, (what, k, got[k], v)


def _same_optimizer(got, want, what):
    _same(got["state"], want["state"], what + " state")
    assert got["param_groups"] == want["param_groups"], (what, got["param_groups"])


@pytest.fixture(scope="module")
def smp_save(tmp_path_factory):
    """A pp=2 job's save_checkpoint after 3 Adam steps, partial and full, and its gathered
    state then and after one more step."""
    d = tmp_path_factory.mktemp("smp_save")
    opts = dict(pp=2, partial_dir=str(d / "partial"), full_dir=str(d / "full"),
                ref=str(d / "ref.pt"))
    _run(SAVE, 2, d, opts)
    return opts, torch.load(opts["ref"])


def _load_plain(dcp_dir):
    """What a plain torch user does with a DCP checkpoint."""
    net = make_net(seed=1)
    opt = torch.optim.Adam(net.parameters(), lr=0.5)  # lr comes from the checkpoint
    sd = {"model": net.state_dict(), "optim": get_optimizer_state_dict(net, opt)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "... a single process"
        dcp.load(sd, checkpoint_id=dcp_dir)
    net.load_state_dict(sd["model"])
    set_optimizer_state_dict(net, opt, sd["optim"])
    return net, opt


@pytest.mark.parametrize("kind", ["partial", "full"])
def test_to_dcp_loads_into_plain_module_and_optimizer(smp_save, tmp_path, kind):
    opts, ref = smp_save
    out = tmp_path / "dcp"
    if kind == "partial":  # the CLI, tag from `newest`
        proc = _cli("to-dcp", opts["partial_dir"], out)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    else:  # the function; a full save outside the job's directory writes no `newest`
        got = smp.checkpoint.to_dcp(opts["full_dir"], out)
        assert got["tag"] == "step3" and got["partial"] is False, got
    net, opt = _load_plain(str(out))
    _same(net.state_dict(), ref["ref"]["model"], f"{kind}: model")
    _same_optimizer(opt.state_dict(), ref["ref"]["optim"], f"{kind}: optimizer")
    assert opt.param_groups[0]["lr"] == 0.01
    # One more step on each side.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1)
    try:
        plain_step(net, opt, 3)
    finally:
        torch.set_num_threads(threads)
    _same(net.state_dict(), ref["next"]["model"], f"{kind}: model after a step")
    _same_optimizer(opt.state_dict(), ref["next"]["optim"], f"{kind}: optimizer after a step")


def test_to_dcp_of_a_sharded_optimizer_state(tmp_path):
    # shard_optimizer_state: each dp rank saved its own share (`optimizer_{pp}_{dp}`).
    opts = dict(dir=str(tmp_path / "ck"), ref=str(tmp_path / "ref.pt"))
    _run(SHARDED, 2, tmp_path, opts)
    assert {"optimizer_0_0", "optimizer_0_1"} <= set(os.listdir(tmp_path / "ck" / "step3_partial"))
    smp.checkpoint.to_dcp(opts["dir"], tmp_path / "dcp")
    net, opt = _load_plain(str(tmp_path / "dcp"))
    ref = torch.load(opts["ref"])
    _same(net.state_dict(), ref["model"], "sharded: model")
    _same_optimizer(opt.state_dict(), ref["optim"], "sharded: optimizer")


def _plain_dcp(tmp_path):
    """A plain process's training and its DCP checkpoint (torch's own way)."""
    net = make_net(seed=2)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for i in range(3):
        plain_step(net, opt, i)
    out = tmp_path / "plain_dcp" / "step3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": net.state_dict(), "optim": get_optimizer_state_dict(net, opt),
                  "epoch": 3}, checkpoint_id=str(out))
    torch.save({"model": net.state_dict(), "optim": opt.state_dict()}, tmp_path / "plain.pt")
    return out, net, opt


def test_from_dcp_resumes_at_pp1_and_pp2(tmp_path):
    src, net, opt = _plain_dcp(tmp_path)
    dst = tmp_path / "smp_ckpt"
    proc = _cli("from-dcp", src, dst)  # tag: the DCP directory's name
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert (dst / "newest").read_text() == "step3"
    # The files: smp's own (trailer, verified on load), the optimizer by name.
    _same(smp.load(str(dst / "step3"), partial=False), net.state_dict(), "model file")
    by_name = smp.load(str(dst / "step3.optimizer"), partial=False)
    assert by_name["_smp_by_name"] is True
    _same_optimizer(smp.checkpoint.optimizer_to_torch(by_name, net), opt.state_dict(),
                    "optimizer file")
    for pp in (1, 2):
        _run(RESUME, pp, tmp_path, dict(pp=pp, dir=str(dst), plain=str(tmp_path / "plain.pt")))


def test_from_dcp_of_a_save_by_two_ranks(tmp_path):
    src, plain = tmp_path / "ddp_dcp", tmp_path / "ddp_plain.pt"
    res = run_ranks(DDP_WRITER, 2, tmp_path, args=(str(src), str(plain)), timeout=120)
    assert all(r.returncode == 0 for r in res), "\n".join(map(repr, res))
    assert len([f for f in os.listdir(src) if f.endswith(".distcp")]) == 2
    assert smp.checkpoint.from_dcp(src, tmp_path / "smp_ckpt") == "ddp_dcp"
    want = torch.load(plain)
    _same(smp.load(str(tmp_path / "smp_ckpt" / "ddp_dcp"), partial=False), want["model"],
          "model file")
    by_name = smp.load(str(tmp_path / "smp_ckpt" / "ddp_dcp.optimizer"), partial=False)
    _same_optimizer(smp.checkpoint.optimizer_to_torch(by_name, make_net()), want["optim"],
                    "optimizer file")
    assert smp.load(str(tmp_path / "smp_ckpt" / "user_content_ddp_dcp"), partial=False) == \
        {"user_content": None, "tag": "ddp_dcp"}


def test_round_trip_smp_dcp_smp(smp_save, tmp_path):
    opts, _ = smp_save
    smp.checkpoint.to_dcp(opts["partial_dir"], tmp_path / "dcp")
    tag = smp.checkpoint.from_dcp(tmp_path / "dcp", tmp_path / "back", tag="again")
    assert tag == "again" and (tmp_path / "back" / "newest").read_text() == "again"
    part = os.path.join(opts["partial_dir"], "step3_partial")
    want_model = smp.checkpoint.merge_partial(os.path.join(part, "model"))
    want_opt = smp.checkpoint.merge_partial(os.path.join(part, "optimizer"))
    got_model = smp.load(str(tmp_path / "back" / "again"), partial=False)
    assert list(got_model) == list(want_model)
    _same(got_model, want_model, "round trip: model")
    got_opt = smp.load(str(tmp_path / "back" / "again.optimizer"), partial=False)
    _same(got_opt["state"], want_opt["state"], "round trip: optimizer state")
    order = {k: i for i, k in enumerate(want_model)}
    assert got_opt["param_groups"] == [dict(g, params=sorted(g["params"], key=order.get))
                                       for g in want_opt["param_groups"]]
    content = smp.load(str(tmp_path / "back" / "user_content_again"), partial=False)
    assert content == {"user_content": {"step": 3, "note": "pp2"}, "tag": "again"}


def test_cli_errors_are_one_line(tmp_path):
    src, _, _ = _plain_dcp(tmp_path)
    proc = _cli("from-dcp", src, tmp_path / "out", "--optim-key", "optimizer")
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "key 'optimizer' is not in DCP checkpoint" in proc.stderr, proc.stderr
    assert "['epoch', 'model', 'optim']" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
    missing = tmp_path / "nowhere"
    proc = _cli("to-dcp", missing, tmp_path / "dcp_out")
    assert proc.returncode == 1 and proc.stderr == \
        f"smp: to-dcp: checkpoint directory '{missing}' does not exist\n", proc.stderr
    assert not (tmp_path / "dcp_out").exists()
