"""Reads by entry (Note [Reads by entry] in checkpoint/mapped.cpp) through
resume_from_checkpoint, on real files and real jobs.

One save at pp=2 is resumed at pp 1, 2 and 4, with dp=2 and a sharded optimizer, and
saved again by those layouts (pp=1, sharded shares) to be resumed once more. Each time:
- the model and the optimizer state are bitwise the saved ones (Adam's moments and step);
- each rank read (and verified) the tensors it keeps and not the rest: the bytes it read
  lie between what it keeps and that plus every file's non-tensor bytes (pickles, entry
  tables, trailers), which is far less than the parts it would read whole;
- a version 1 file (an older smp's layout, no entry table) still resumes;
- a damaged record a rank keeps is named on every rank, one it does not keep is not read.
"""
import json
import os
import shutil

import pytest
import torch

import smp._C as _C
from conftest import run_ranks

JOB = r"""
import json, os, sys
import torch, torch.nn as nn
import smp
import smp._C as _C
opts = json.loads(sys.argv[1])
smp.init(dict(opts["cfg"], timeout_s=60))
torch.manual_seed(0)
net = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(128, 128), nn.Tanh())])
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01))

@smp.step
def train_step(x):
    loss = model(x).square().mean()
    model.backward(loss)
    return loss

def step(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(4 * smp.dp_size(), 128, generator=g)[4 * smp.dp_rank():4 * (smp.dp_rank() + 1)]
    opt.zero_grad()
    train_step(x)
    opt.step()

path = opts["path"]
if opts.get("resume"):
    before = _C.checkpoint_bytes_read()
    @smp.step
    def fwd(x):
        return model(x)
    try:
        smp.resume_from_checkpoint(path, tag=opts["resume"],
                                   load_optimizer=opts.get("load_optimizer", True))
        fwd(torch.zeros(4, 128))   # partitions: the deferred loads are applied
    except smp.CheckpointError as e:
        print("ERROR", json.dumps(str(e)), flush=True)
        sys.exit(3)
    read = _C.checkpoint_bytes_read() - before
    keep = set()
    kept = 0
    for t in list(model.local_state_dict().values()) + [
            v for s in opt.state.values() for v in s.values()]:
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in keep:
            keep.add(t.untyped_storage().data_ptr())
            kept += t.untyped_storage().nbytes()
    print("READ", json.dumps({"read": read, "kept": kept, "rank": smp.rank()}), flush=True)
    full, osd = model.state_dict(), opt.state_dict()
    want = torch.load(os.path.join(path, f"full_{opts['resume']}.pt"))
    if not opts.get("load_optimizer", True):
        want["opt"] = {"state": {}}
    for k, v in want["model"].items():
        assert torch.equal(full[k], v), f"model {k} differs"
    for i, s in want["opt"]["state"].items():
        for k, v in s.items():
            got = osd["state"][i][k]
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(v)), f"opt {i} {k} differs"
else:
    for i in range(2):
        step(i)
if opts.get("save"):
    step(5)
    smp.save_checkpoint(path, opts["save"], partial=True)
    full, osd = model.state_dict(), opt.state_dict()
    if smp.rank() == 0:
        torch.save({"model": full, "opt": osd}, os.path.join(path, f"full_{opts['save']}.pt"))
print("DONE", flush=True)
"""


def _job(tmp_path, world, cfg, **opts):
    res = run_ranks(JOB, world, tmp_path, timeout=150,
                    args=(json.dumps(dict(opts, cfg=dict(cfg, microbatches=2))),))
    return res


@pytest.fixture(scope="module")
def _saved_a(tmp_path_factory):
    """The pp=2 job's save "a" (2 steps, then step 5, then save_checkpoint), made once for
    the module; each test resumes, damages or rewrites its own copy (`_copy_of_a`)."""
    tmp = tmp_path_factory.mktemp("saved_a")
    path = str(tmp / "ck")
    _ok(_job(tmp, 2, {"partitions": 2}, path=path, save="a"))
    return path


def _copy_of_a(saved, tmp_path):
    path = str(tmp_path / "ck")
    shutil.copytree(saved, path)
    return path


def _ok(res):
    bad = [r for r in res if r.returncode != 0]
    assert not bad, "\n".join(map(repr, bad))
    return [json.loads(r.stdout.split("READ ", 1)[1].splitlines()[0])
            for r in res if "READ " in r.stdout]


def _save_files(path, tag):
    d = os.path.join(path, f"{tag}_partial")
    return [os.path.join(d, n) for n in os.listdir(d)
            if n.startswith(("model_", "optimizer_")) and ".prev" not in n]


def _sizes(files):
    """(bytes of tensor records, every other byte) over `files`."""
    data = other = 0
    for p in files:
        f = _C.CheckpointFile(p)
        d = sum(f.size_of(n) for n in f.names() if n.startswith("data/"))
        data += d
        other += os.path.getsize(p) - d
    return data, other


def _assert_read_what_kept(reads, files):
    data, other = _sizes(files)
    for r in reads:
        assert r["kept"] <= r["read"] <= r["kept"] + other, (r, data, other)


def test_resharding_reads_only_what_each_rank_keeps(_saved_a, tmp_path):
    path = _copy_of_a(_saved_a, tmp_path)
    files_a = _save_files(path, "a")
    data_a, other_a = _sizes(files_a)
    # pp 2 -> 1: the one rank keeps everything; saves a one-part checkpoint.
    reads = _ok(_job(tmp_path, 1, {"partitions": 1}, path=path, resume="a", save="b"))
    _assert_read_what_kept(reads, files_a)
    assert reads[0]["kept"] == data_a
    # pp 1 -> 2: each rank keeps half of the one part, and reads about that.
    files_b = _save_files(path, "b")
    data_b, _ = _sizes(files_b)
    reads = _ok(_job(tmp_path, 2, {"partitions": 2}, path=path, resume="b"))
    _assert_read_what_kept(reads, files_b)
    assert all(r["read"] < 0.7 * data_b for r in reads), (reads, data_b)
    # pp 2 -> 4 (a quarter each), and pp=2 x dp=2 with a sharded optimizer, which saves
    # its shares; those resume at pp=1.
    reads = _ok(_job(tmp_path, 4, {"partitions": 4}, path=path, resume="a"))
    _assert_read_what_kept(reads, files_a)
    assert all(r["read"] < 0.45 * data_a for r in reads), (reads, data_a)
    sharded = {"partitions": 2, "ddp": True, "shard_optimizer_state": True}
    reads = _ok(_job(tmp_path, 4, sharded, path=path, resume="a", save="e"))
    _assert_read_what_kept(reads, files_a)
    reads = _ok(_job(tmp_path, 1, {"partitions": 1}, path=path, resume="e"))
    _assert_read_what_kept(reads, _save_files(path, "e"))


def _flip_first_tensor(part):
    """Flips a byte of the first tensor record of `part`; returns the record's name."""
    f = _C.CheckpointFile(part)
    victim = next(n for n in f.names() if n.startswith("data/"))
    head = f.record(victim).numpy().tobytes()[:64]
    del f
    with open(part, "r+b") as fh:
        raw = fh.read()
        at = raw.index(head) + 5
        fh.seek(at)
        fh.write(bytes([raw[at] ^ 0x20]))
    return victim


def _errors(res):
    return [json.loads(r.stdout.split("ERROR ", 1)[1].splitlines()[0]) for r in res
            if "ERROR " in r.stdout]


def test_damaged_record_named_on_every_rank_only_when_kept(_saved_a, tmp_path):
    path = _copy_of_a(_saved_a, tmp_path)
    d = os.path.join(path, "a_partial")
    # An optimizer record nobody keeps (load_optimizer=False) is never read.
    _flip_first_tensor(os.path.join(d, "optimizer_1"))
    _ok(_job(tmp_path, 2, {"partitions": 2}, path=path, resume="a", load_optimizer=False))
    # A model record pp rank 1 keeps: named on both ranks, the same text.
    victim = _flip_first_tensor(os.path.join(d, "model_1"))
    res = _job(tmp_path, 2, {"partitions": 2}, path=path, resume="a")
    errs = _errors(res)
    assert len(errs) == 2 and errs[0] == errs[1], res
    assert f"record '{victim}'" in errs[0] and "model_1" in errs[0], errs[0]
    assert all(r.returncode == 3 for r in res), res


def test_version_one_checkpoint_still_resumes(_saved_a, tmp_path):
    """Rewrites a save's files in the version 1 layout (torch.save's zip sealed whole,
    no entry table), as an older smp wrote them; resume is still exact."""
    path = _copy_of_a(_saved_a, tmp_path)
    d = os.path.join(path, "a_partial")
    for name in os.listdir(d):
        p = os.path.join(d, name)
        if not _C.checkpoint_has_manifest(p):
            continue
        m = _C.checkpoint_read_manifest(p)
        obj = __import__("smp").load(p, partial=False)
        tmp = p + ".v1tmp"
        torch.save(obj, tmp)
        m1 = _C.checkpoint_seal(tmp, m)
        assert m1.format_version == 1 and m1.entry_chunk == 0
        os.replace(tmp, p)
    reads = _ok(_job(tmp_path, 2, {"partitions": 2}, path=path, resume="a"))
    assert reads and all(r["read"] == 0 for r in reads), reads  # read whole, not by entry
