"""Asynchronous saves (`async_save=True`) on real files, by real multi-rank jobs.

- pp=2 x dp=2 training saves asynchronously and changes its parameters right after the
  call returns: the files hold the state at the call, `newest` names the tag only once
  the save settled, and a job resumed from it ends bitwise equal to the uninterrupted run;
- a SIGKILL at times spread over the writer's work leaves the old or the new save whole,
  never a half one (many runs);
- a writer failure (a full disk: a 2 MB tmpfs) is raised on every rank, at the same step
  end, naming the file;
- bad arguments name the setting.
"""
import json
import os
import random
import subprocess

import pytest
import torch

from conftest import run_ranks, run_with_options

COMMON = r"""
import json, os, sys, time
import torch, torch.nn as nn
import smp
opts = json.loads(sys.argv[1])
smp.init(dict(opts["cfg"], timeout_s=opts.get("timeout_s", 60)))
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 64), nn.Tanh(),
                    nn.Linear(64, 3))
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))

def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8 * smp.dp_size(), 8, generator=g), torch.randn(8 * smp.dp_size(), 3, generator=g)
    sl = slice(8 * smp.dp_rank(), 8 * (smp.dp_rank() + 1))
    return x[sl], y[sl]

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

def step(i):
    torch.manual_seed(77 + i)  # dropout's draws depend on the step only
    x, y = batch(i)
    opt.zero_grad()
    train_step(x, y)
    opt.step()
"""

TRAIN = COMMON + r"""
path = opts["path"]
for i in range(opts["steps"]):
    if i in opts["save_at"]:
        tag = f"s{i}"
        at_call = {k: v.clone() for k, v in model.local_state_dict().items()
                   if torch.is_tensor(v)}
        fut = smp.save_checkpoint(path, tag, partial=True, async_save=True)
        assert isinstance(fut, smp.checkpoint.SaveFuture), fut
        # Training goes on at once: scribble over every parameter while the writer works,
        # then put the values back (the file must hold the state at the call).
        with torch.no_grad():
            live = model.local_state_dict(cast_to_cpu=False)
            for k, v in live.items():
                if torch.is_tensor(v) and v.is_floating_point():
                    v.mul_(-3.0).add_(1.0)
            deadline = time.monotonic() + 0.5
            while not fut.done() and time.monotonic() < deadline:
                time.sleep(0.005)
            for k, v in live.items():
                if torch.is_tensor(v) and v.is_floating_point():
                    v.copy_(at_call[k])
        if i == opts["save_at"][0]:
            newest = os.path.join(path, "newest")
            before = open(newest).read() if os.path.exists(newest) else None
            assert before != tag, "newest named the tag before the save settled"
            fut.wait()
            assert open(newest).read() == tag
            torch.save(at_call, os.path.join(path, f"at_call_{tag}_{smp.rank()}.pt"))
    step(i)
full = model.state_dict()
if smp.rank() == 0:
    torch.save(full, opts["final"])
print("TRAINED", flush=True)
"""

RESUME = COMMON + r"""
path, tag = opts["path"], opts["tag"]
smp.resume_from_checkpoint(path, tag=tag)
if opts.get("check_at_call"):
    # Before training on: the loaded state is the one at the save call. A forward-only
    # step partitions and applies the deferred load; it changes no parameter, and each
    # step() reseeds what dropout draws.
    @smp.step
    def fwd(x):
        return model(x)
    fwd(batch(0)[0])
    got = model.local_state_dict()
    want = torch.load(os.path.join(path, f"at_call_{tag}_{smp.rank()}.pt"))
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{k}: the file does not hold the state at the call"
start = int(tag[1:])
for i in range(start, opts["steps"]):
    step(i)
full = model.state_dict()
want = torch.load(opts["final"])
for k, v in want.items():
    assert torch.equal(full[k], v), f"{k}: resumed run differs from the uninterrupted one"
print("RESUMED", flush=True)
"""

def _run(script, world, tmp_path, opts, **kw):
    return run_with_options(script, world, tmp_path, opts, **kw)


def test_async_save_holds_the_state_at_the_call_and_resumes_bitwise(tmp_path):
    path, final = str(tmp_path / "ck"), str(tmp_path / "final.pt")
    cfg = {"partitions": 2, "microbatches": 2, "ddp": True}
    base = dict(path=path, final=final, steps=7, save_at=[2, 4], cfg=cfg)
    # A slow disk (each write starts 300 ms late): the scribbles surely come first.
    _run(TRAIN, 4, tmp_path, base, env={"SMP_CHECKPOINT_WRITER_PAUSE_MS": "300"})
    assert open(os.path.join(path, "newest")).read() == "s4"  # settled by the exit
    _run(RESUME, 4, tmp_path, dict(base, tag="s2", check_at_call=True))
    _run(RESUME, 4, tmp_path, dict(base, tag="s4"))


KILLED = r"""
import json, os, random, signal, sys, threading, time
import torch
import smp
opts = json.loads(sys.argv[1])
smp.init({"partitions": 2, "microbatches": 1, "timeout_s": 20})
name = os.path.join(opts["dir"], "ck")
w = torch.full((3_000_000,), float(smp.pp_rank()))
smp.save({"tag": "old", f"w{smp.pp_rank()}": w}, name, partial=True)
w.fill_(10.0 + smp.pp_rank())
fut = smp.save({"tag": "new", f"w{smp.pp_rank()}": w}, name, partial=True, async_save=True)
w.fill_(-1.0)  # never in a file
delay = opts["delays"][smp.pp_rank()]
threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
time.sleep(30)
"""


def _load_whole(d):
    """What the name holds now, read as a user would (the newest whole save; no job)."""
    from smp.checkpoint import merge_partial
    m = merge_partial(os.path.join(d, "ck"))
    return f"{m['tag']} {sorted(set(m['w0'].tolist()))} {sorted(set(m['w1'].tolist()))}"


def test_sigkill_during_async_write_leaves_old_or_new(tmp_path):
    rng = random.Random(5)
    seen = set()
    for run in range(5):
        d = tmp_path / f"run{run}"
        d.mkdir()
        # Kill points spread from the call's return to past the end of the write (a
        # 12 MB part takes some 30-120 ms here), each rank at its own moment.
        delays = [rng.uniform(0.0, 0.15), rng.uniform(0.0, 0.15)]
        res = run_ranks(KILLED, 2, d, args=(json.dumps(dict(dir=str(d), delays=delays)),),
                        timeout=60)
        assert all(r.returncode == -9 for r in res), res
        got = _load_whole(str(d))
        tag = got.split()[0]
        assert got in ("old [0.0] [1.0]", "new [10.0] [11.0]"), (delays, got)
        seen.add(tag)
    # Over the runs, both outcomes (a save cut short, one finished) are exercised.
    assert seen == {"old", "new"}, seen


FULL_DISK = COMMON + r"""
path = opts["path"]
step(0)
fut = smp.save({"w": torch.randn(1_000_000), "r": smp.rank()}, os.path.join(path, "big"),
               partial=True, async_save=True)
raised = None
for i in range(1, 40):
    try:
        step(i)
    except smp.CheckpointError as e:
        raised = (i, str(e))
        break
    time.sleep(0.02)
assert raised is not None, "the writer's failure was never raised"
print("RAISED", json.dumps(raised), flush=True)
"""


def test_writer_failure_is_named_on_every_rank(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a 2 MB tmpfs here (not root): no full disk to write to")
    try:
        res = _run(FULL_DISK, 2, tmp_path, dict(path=str(d), cfg={"partitions": 2,
                                                                   "microbatches": 1}))
        got = [json.loads(r.stdout.split("RAISED ", 1)[1].splitlines()[0]) for r in res]
        assert got[0] == got[1], got  # the same step, the same message, on every rank
        msg = got[0][1]
        assert "big_" in msg and "No space left on device" in msg, msg
        assert "smp.save(async_save=True)" in msg, msg
    finally:
        subprocess.run(["umount", str(d)])


def test_bad_arguments(tmp_path):
    import smp
    with pytest.raises(ValueError, match="async_save"):
        smp.save({}, str(tmp_path / "x"), partial=False, async_save="yes")
    fut = smp.save({"a": torch.ones(3)}, str(tmp_path / "x"), partial=False, async_save=True)
    fut.wait()
    assert fut.done()
    assert torch.equal(smp.load(str(tmp_path / "x"), partial=False)["a"], torch.ones(3))
    # A missing directory: the call returns (no collective at the call), and settling
    # raises smp.save's message on every rank of the save.
    fut = smp.save({"a": torch.ones(3)}, str(tmp_path / "nope" / "x"), partial=True,
                   async_save=True)
    with pytest.raises(smp.CheckpointError, match="does not exist"):
        fut.wait()
