"""Checkpoints on real files, written and read by real multi-rank jobs.

- resume equals the uninterrupted run exactly (same partitioning), and matches the
  single-process reference after resharding 2->1, 2->4, 4->2 (Adam), pp=2 x dp=2 (SGD
  with momentum), with the Hugging Face SMP save/resume sequence in one of them;
- a full checkpoint loads into the plain module with torch.load;
- truncated, altered, missing and mixed files raise smp.CheckpointError naming the file,
  on every rank; a saving rank SIGKILLed at several moments leaves the old or the new
  save whole;
- save_checkpoint keeps N, resume_from_checkpoint (partial, full, HF's plain file);
- post-step / post-partition hooks; comm hook state pickling;
- `python -m smp.checkpoint merge` of a real pp=2 partial save loads into the plain
  module and equals the gathered state dict (optimizer too, through
  optimizer_to_torch); missing, repeated, mixed and damaged parts are named;
- smp.save into a missing directory says what to do, the same on every rank;
- smp.load's weights_only follows torch.load: tensors, model and optimizer states load
  weights-only; smp's hook objects load by default (pickle_module=pickle) and are refused
  with weights_only=True, naming the file, on every pp rank.
"""
import json
import os
import pickle
import re
import shutil

import pytest
import torch

import smp
from conftest import PYTHON, run_ranks, run_with_options

COMMON = r"""
import json, os, sys, copy
import torch, torch.nn as nn
import smp
opts = json.loads(sys.argv[1])
smp.init(dict(opts["cfg"], timeout_s=opts.get("timeout_s", 60)))
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                    nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
ref = copy.deepcopy(net)

def make_opt(params):
    if opts.get("opt", "adam") == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)

opt = make_opt(net.parameters())
ref_opt = make_opt(ref.parameters())
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(opt)
mb = opts["cfg"].get("microbatches", 1)

def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8 * smp.dp_size(), 8, generator=g), torch.randn(8 * smp.dp_size(), 3, generator=g)
    sl = slice(8 * smp.dp_rank(), 8 * (smp.dp_rank() + 1))
    return x[sl], y[sl], x, y

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

def ref_step(step):
    # The same step in one process: the full batch, the same microbatch split and mean.
    _, _, x, y = batch(step)
    ref_opt.zero_grad()
    n = x.shape[0] // (mb * smp.dp_size())
    for d in range(smp.dp_size()):
        for m in range(mb):
            s = slice(8 * d + n * m, 8 * d + n * (m + 1))
            (nn.functional.mse_loss(ref(x[s]), y[s]) / (mb * smp.dp_size())).backward()
    ref_opt.step()

def step(i):
    x, y, _, _ = batch(i)
    opt.zero_grad()
    train_step(x, y)
    opt.step()
"""

TRAIN = COMMON + r"""
# Uninterrupted run: save at step `save_at` (partial, every rank calls), keep going.
ckpt = opts["ckpt"]
for i in range(opts["steps"]):
    if i == opts["save_at"]:
        if opts.get("hf"):
            # Hugging Face's SMP sequence (trainer.py _save_checkpoint).
            opt_sd = opt.local_state_dict(gather_if_shard=False)
            smp.barrier()
            if smp.rdp_rank() == 0:
                smp.save(opt_sd, ckpt + ".opt", partial=True, v3=False)
            smp.save(model.local_state_dict(), ckpt + ".model", partial=True)
        else:
            smp.save({"model": model.local_state_dict(), "opt": opt.local_state_dict(),
                      "step": i}, ckpt, partial=True)
    step(i)
full = model.state_dict()
if smp.rank() == 0:
    torch.save(full, opts["final"])
print("TRAINED", flush=True)
"""

RESUME = COMMON + r"""
ckpt = opts["ckpt"]
start = opts["save_at"]
if opts.get("hf"):
    model.load_state_dict(smp.load(ckpt + ".model", partial=True), same_partition_load=False)
    def opt_load_hook(mod, o):
        o.load_state_dict(smp.load(ckpt + ".opt", partial=True))
    handle = model.register_post_step_hook(opt_load_hook)
else:
    state = smp.load(ckpt, partial=True)
    assert state["step"] == start, state["step"]
    model.load_state_dict(state["model"])   # before the first step: applied after partitioning
    opt.load_state_dict(state["opt"])
for i in range(start, opts["steps"]):
    if opts.get("hf") and i == start + 1:
        handle.remove()
    if opts.get("resave_at") == i:
        smp.save({"model": model.local_state_dict(), "opt": opt.local_state_dict(), "step": i},
                 opts["resave"], partial=True)
    step(i)
full = model.state_dict()
want = torch.load(opts["final"])
for k, v in want.items():
    if opts.get("exact"):
        assert torch.equal(full[k], v), f"{k}: resumed run differs from the uninterrupted one"
    else:
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
# The single-process reference, trained from scratch.
for i in range(opts["steps"]):
    ref_step(i)
for k, v in ref.state_dict().items():
    torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"ref {k}: {m}")
print("RESUMED", flush=True)
"""


def _run(script, world, tmp_path, opts, **kw):
    return run_with_options(script, world, tmp_path, opts, **kw)


def test_resume_exact_and_reshard_adam(tmp_path):
    ck, final = str(tmp_path / "ck.pt"), str(tmp_path / "final.pt")
    base = dict(ckpt=ck, final=final, steps=5, save_at=2, opt="adam")
    _run(TRAIN, 2, tmp_path, dict(base, cfg={"partitions": 2, "microbatches": 2}))
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("ck.pt")) == \
        ["ck.pt_0", "ck.pt_1"]
    # Same partitioning: bit for bit the uninterrupted run.
    _run(RESUME, 2, tmp_path, dict(base, exact=True, cfg={"partitions": 2, "microbatches": 2}))
    # 2 -> 1.
    _run(RESUME, 1, tmp_path, dict(base, cfg={"partitions": 1, "microbatches": 2}))
    # 2 -> 4, saving again at step 3 with 4 parts; then 4 -> 2.
    ck4 = str(tmp_path / "ck4.pt")
    _run(RESUME, 4, tmp_path, dict(base, resave_at=3, resave=ck4,
                                    cfg={"partitions": 4, "microbatches": 2}))
    assert os.path.exists(ck4 + "_3")
    _run(RESUME, 2, tmp_path, dict(base, ckpt=ck4, save_at=3,
                                    cfg={"partitions": 2, "microbatches": 2}))


def test_resume_exact_pp2_dp2_sgd_momentum_hf_sequence(tmp_path):
    ck, final = str(tmp_path / "ck.pt"), str(tmp_path / "final.pt")
    cfg = {"partitions": 2, "microbatches": 2, "ddp": True}
    base = dict(ckpt=ck, final=final, steps=4, save_at=2, opt="sgd", hf=True, cfg=cfg)
    _run(TRAIN, 4, tmp_path, base)
    _run(RESUME, 4, tmp_path, dict(base, exact=True))


FULL = COMMON + r"""
for i in range(2):
    step(i)
sd, osd = model.state_dict(gather_to_rank0=True), opt.state_dict(gather_to_rank0=True)
if smp.rank() == 0:
    smp.save({"model": sd, "opt": osd}, opts["ckpt"], partial=False)
    for i in range(2):
        ref_step(i)
    torch.save(ref.state_dict(), opts["final"])
else:
    assert sd == {} and osd == {}, "gather_to_rank0 gave a non-zero rank the state"
"""


def test_full_checkpoint_loads_into_plain_module(tmp_path):
    ck, final = str(tmp_path / "full.pt"), str(tmp_path / "ref.pt")
    _run(FULL, 2, tmp_path, dict(ckpt=ck, final=final, opt="adam",
                                 cfg={"partitions": 2, "microbatches": 2}))
    obj = torch.load(ck)  # plain torch.load reads an smp full file
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3))
    plain.load_state_dict(obj["model"])
    for k, v in torch.load(final).items():
        torch.testing.assert_close(plain.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    popt = torch.optim.Adam(plain.parameters(), lr=0.01)
    popt.load_state_dict(obj["opt"])  # the full optimizer dict is torch's own format
    assert len(popt.state) == 8
    assert torch.equal(smp.load(ck, partial=False)["model"]["6.bias"], obj["model"]["6.bias"])


# --- damaged files ----------------------------------------------------------------------

SAVE2 = r"""
import json, sys, torch, smp
opts = json.loads(sys.argv[1])
smp.init({"partitions": 2, "timeout_s": opts.get("timeout_s", 30)})
for tag in opts["tags"]:
    smp.save({"w": torch.full((1000,), float(smp.pp_rank())), "tag": tag}, opts["dir"] + "/" + tag,
             partial=True)
"""

LOAD2 = r"""
import json, sys, smp
opts = json.loads(sys.argv[1])
smp.init({"partitions": 2, "timeout_s": 30})
try:
    smp.load(opts["path"], partial=True)
    print("LOADED", flush=True)
except smp.CheckpointError as e:
    print("CHECKPOINT_ERROR", e, flush=True)
"""


def _load_in_process(path):
    return smp.load(path, partial=True)


def test_damaged_checkpoints_are_named(tmp_path):
    d = str(tmp_path)
    _run(SAVE2, 2, tmp_path, dict(dir=d, tags=["a", "b"]))
    # Whole: in this process (pp_size 1) both parts merge.
    assert _load_in_process(d + "/a")["tag"] == "a"

    def expect(path, *words):
        with pytest.raises(smp.CheckpointError) as e:
            _load_in_process(path)
        for w in words:
            assert w in str(e.value), str(e.value)
        return str(e.value)

    # Truncated part 1.
    shutil.copy(d + "/a_0", d + "/t_0")
    shutil.copy(d + "/a_1", d + "/t_1")
    with open(d + "/t_1", "r+b") as f:
        f.truncate(os.path.getsize(d + "/t_1") - 100)
    expect(d + "/t", "t_1", "truncated")
    # A flipped byte inside the tensor data.
    shutil.copy(d + "/a_0", d + "/f_0")
    shutil.copy(d + "/a_1", d + "/f_1")
    with open(d + "/f_0", "r+b") as f:
        f.seek(2000)
        b = f.read(1)
        f.seek(2000)
        f.write(bytes([b[0] ^ 1]))
    expect(d + "/f", "f_0", "checksum mismatch")
    # Missing part.
    shutil.copy(d + "/a_0", d + "/m_0")
    expect(d + "/m", "m_1' missing")
    # Parts of two saves.
    shutil.copy(d + "/a_0", d + "/x_0")
    shutil.copy(d + "/b_1", d + "/x_1")
    expect(d + "/x", "different saves")
    # Every rank of a 2-rank job raises, naming the file.
    res = _run(LOAD2, 2, tmp_path, dict(path=d + "/f"))
    for r in res:
        assert "CHECKPOINT_ERROR" in r.stdout and "f_0" in r.stdout, r
    # A full file: truncated, and a plain torch.save file still loads.
    smp.save({"v": torch.arange(10)}, d + "/full.pt", partial=False)
    assert torch.equal(torch.load(d + "/full.pt")["v"], torch.arange(10))
    shutil.copy(d + "/full.pt", d + "/full2.pt")
    with open(d + "/full2.pt", "r+b") as f:
        f.truncate(300)
    with pytest.raises(smp.CheckpointError, match="full2.pt"):
        smp.load(d + "/full2.pt", partial=False)
    torch.save({"v": 3}, d + "/plain.pt")
    assert smp.load(d + "/plain.pt", partial=False) == {"v": 3}


@pytest.mark.parametrize("stage", ["after_write:1", "after_seal:0", "before_rename:1",
                                   "after_rename:0"])
def test_sigkill_while_saving_leaves_old_or_new(tmp_path, stage):
    d = str(tmp_path)
    _run(SAVE2, 2, tmp_path, dict(dir=d, tags=["c"]))
    # The second save to the same name dies at `stage` (SIGKILL of that pp rank).
    script = SAVE2.replace('"tag": tag', '"tag": "new"')
    res = run_ranks(script, 2, tmp_path, args=(json.dumps(dict(dir=d, tags=["c"], timeout_s=5)),),
                    timeout=60, env={"SMP_CHECKPOINT_CRASH_AT": stage})
    killed = int(stage.split(":")[1])
    assert res[killed].returncode == -9, res[killed]
    got = _load_in_process(d + "/c")  # never an error
    assert got["tag"] in ("c", "new")
    # A whole save: both parts' tensors came from that save (w holds each part's pp rank).
    assert got["w"].shape == (1000,)
    if stage != "after_rename:0":
        assert got["tag"] == "c", "rank 1 never renamed: only the old save is whole"


# --- save_checkpoint / resume_from_checkpoint --------------------------------------------

SAVECK = COMMON + r"""
path = opts["path"]
for i in range(4):
    step(i)
    smp.save_checkpoint(path, f"step{i}", partial=True, model=model, optimizer=opt,
                        user_content={"step": i}, num_kept_partial_checkpoints=2)
smp.save_checkpoint(path, "full", partial=False, model=model, optimizer=opt,
                    user_content={"step": 99})
full = model.state_dict()
if smp.rank() == 0:
    torch.save(full, path + "/final_ref.pt")
"""

RESUMECK = COMMON + r"""
path = opts["path"]
if opts["kind"] == "partial":
    content = smp.resume_from_checkpoint(path)       # tag from path/newest
    assert content == {"step": 3}, content
elif opts["kind"] == "full":
    content = smp.resume_from_checkpoint(path, tag="full", partial=False)
    assert content == {"step": 99}, content
else:   # Hugging Face: a plain torch.save'd model state dict
    smp.resume_from_checkpoint(path, tag="pytorch_model.bin", partial=False, load_optimizer=False)
ran = []
model.register_post_partition_hook(lambda m, o: ran.append("early"))
x, y, _, _ = batch(0)
train_step(x, y)     # forward and backward only: the loaded parameters stay     # partitions, then the deferred loads, then the hooks
model.register_post_partition_hook(lambda m, o: ran.append("late"))  # runs at once
assert ran == ["early", "late"], ran
full = model.state_dict()
want = torch.load(path + "/final_ref.pt")
for k, v in want.items():
    assert torch.equal(full[k], v), k
print("OK", flush=True)
"""


def test_save_checkpoint_keeps_n_and_resumes(tmp_path):
    path = str(tmp_path / "ckpts")
    cfg = {"partitions": 2, "microbatches": 2}
    _run(SAVECK, 2, tmp_path, dict(path=path, cfg=cfg))
    names = sorted(os.listdir(path))
    assert [n for n in names if n.endswith("_partial")] == ["step2_partial", "step3_partial"]
    assert open(os.path.join(path, "newest")).read() == "step3"
    torch.save(torch.load(os.path.join(path, "full")), os.path.join(path, "pytorch_model.bin"))
    for kind in ("partial", "full", "hf"):
        _run(RESUMECK, 2, tmp_path, dict(path=path, kind=kind, cfg=cfg))


# --- hooks and comm hook state -------------------------------------------------------------

class _HookState:
    def __init__(self, process_group):
        self.process_group = process_group
        self.iteration = 7


def test_comm_hook_state_pickles_without_process_group(tmp_path):
    from smp.ddp_comm_hooks import default_hooks
    state = _HookState(process_group=object())   # not picklable
    smp.save({"comm_hook": default_hooks.allreduce_hook, "comm_hook_state": state},
             str(tmp_path / "h.pt"), partial=False)
    got = smp.load(str(tmp_path / "h.pt"), partial=False)
    assert got["comm_hook"] is default_hooks.allreduce_hook
    assert got["comm_hook_state"].iteration == 7
    assert got["comm_hook_state"].process_group is None  # smp not initialised here
    assert state.process_group is not None  # the caller's state is untouched


def test_powersgd_state_pickles_as_plain_data_and_reads_older_pickles():
    # Note [Hook state loads weights-only]: the pickle holds the random stream as its
    # MT19937 key and position (no numpy object), so torch.load's weights-only default
    # loads it; a state in torch's form (what this class pickled before: `rng` a numpy
    # RandomState) still restores the same state.
    import io
    from smp.ddp_comm_hooks import powerSGD_hook as psgd
    state = psgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3,
                               random_seed=11)
    plain = state.__getstate__()
    assert "rng" not in plain and len(plain["rng_key"]) == 624, sorted(plain)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    for got in (torch.load(buf, weights_only=True), psgd.PowerSGDState.__new__(psgd.PowerSGDState)):
        if not hasattr(got, "_native"):
            got.__setstate__(state.state_dict())  # the older pickle's form
        a, b = got.state_dict(), state.state_dict()
        ra, rb = a.pop("rng"), b.pop("rng")
        assert a == b, (a, b)
        assert all((x == y).all() if hasattr(x, "all") else x == y
                   for x, y in zip(ra.get_state(), rb.get_state()))


def test_bad_arguments():
    with pytest.raises(ValueError, match="partial"):
        smp.save({}, "x", partial="yes")
    with pytest.raises(ValueError, match="not a path"):
        smp.load(3)
    with pytest.raises(smp.CheckpointError, match="does not exist"):
        smp.load("/nonexistent/file.pt", partial=False)
    with pytest.raises(smp.CheckpointError, match="no complete save"):
        smp.load("/nonexistent/file.pt", partial=True)


POWERSGD_SAVE = r"""
import sys, torch, smp
from smp.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd
smp.init({})
state = psgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3,
                           random_seed=11)
hook = default_hooks.fp16_compress_wrapper(psgd.batched_powerSGD_hook)
smp.save({"comm_hook": hook, "plain": psgd.powerSGD_hook, "comm_hook_state": state},
         sys.argv[1], partial=False)
got = smp.load(sys.argv[1], partial=False)
assert got["plain"] is psgd.powerSGD_hook
assert got["comm_hook"] == hook and "batched_powerSGD_hook" in repr(got["comm_hook"])
s = got["comm_hook_state"]
assert s.process_group is smp.get_dp_process_group()  # rebound on load
a, b = s.state_dict(), state.state_dict()
ra, rb = a.pop("rng"), b.pop("rng")
assert a == b, (a, b)
assert all((x == y).all() if hasattr(x, "all") else x == y
           for x, y in zip(ra.get_state(), rb.get_state()))  # the same random stream
print("OK")
"""


def test_powersgd_hook_and_state_through_smp_save(tmp_path):
    script = tmp_path / "psgd_save.py"
    script.write_text(POWERSGD_SAVE)
    import subprocess
    from conftest import rank_env, free_port
    out = subprocess.run([PYTHON, str(script), str(tmp_path / "hook.pt")], capture_output=True,
                         text=True, env=rank_env(0, 1, free_port()), timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


# --- merging a partial save into one plain state dict (python -m smp.checkpoint merge) ----

MERGE_SAVE = COMMON + r"""
import shutil
for i in range(3):
    step(i)
ck = opts["ckpt"]
smp.save(model.local_state_dict(), ck, partial=True)
smp.save({"model": model.local_state_dict(), "opt": opt.local_state_dict(), "step": 3},
         ck + ".both", partial=True)
full, osd = model.state_dict(), opt.state_dict()   # gathered (collective)
# One checkpoint name saved twice: keep this rank's part of the first save aside.
smp.save(model.local_state_dict(), ck + ".twice", partial=True)
shutil.copy(f"{ck}.twice_{smp.pp_rank()}", f"{ck}.first_{smp.pp_rank()}")
step(3)
smp.save(model.local_state_dict(), ck + ".twice", partial=True)
later = model.state_dict()
if smp.rank() == 0:
    torch.save({"model": full, "opt": osd, "later": later}, opts["final"])
"""


def _plain():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def _merge_cli(*args):
    import subprocess
    from conftest import rank_env, free_port
    return subprocess.run([PYTHON, "-m", "smp.checkpoint", "merge", *map(str, args)],
                          capture_output=True, text=True, env=rank_env(0, 1, free_port()),
                          timeout=120)


def _assert_same_state(got, want, what):
    assert list(sorted(got)) == list(sorted(want)), (what, sorted(got), sorted(want))
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{what}: {k} differs"


def test_merge_partial_save_loads_into_plain_module(tmp_path):
    ck, final = str(tmp_path / "ck.pt"), str(tmp_path / "full.pt")
    _run(MERGE_SAVE, 2, tmp_path, dict(ckpt=ck, final=final, opt="adam",
                                       cfg={"partitions": 2, "microbatches": 2}))
    want = torch.load(final)
    # Parts in any order; nothing on stderr (no runpy warning either).
    out = tmp_path / "merged.pt"
    proc = _merge_cli(ck + "_1", ck + "_0", out)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    merged = torch.load(out)
    plain, ref = _plain(), _plain()
    plain.load_state_dict(merged)             # strict: exactly the plain module's keys
    ref.load_state_dict(want["model"])
    _assert_same_state(plain.state_dict(), want["model"], "merged model")
    x = torch.randn(5, 8)
    assert torch.equal(plain(x), ref(x))
    # The function, from the name given to smp.save (the newest complete save).
    _assert_same_state(smp.checkpoint.merge_partial(ck), want["model"], "merge_partial(name)")
    # Model and optimizer in one save: --key picks an entry; the optimizer's by-name
    # state converts to torch's positional format for a plain optimizer.
    proc = _merge_cli("--key", "model", ck + ".both_0", ck + ".both_1", tmp_path / "m.pt")
    assert proc.returncode == 0, proc.stderr
    _assert_same_state(torch.load(tmp_path / "m.pt"), want["model"], "--key model")
    both = smp.checkpoint.merge_partial([ck + ".both_0", ck + ".both_1"])
    assert both["step"] == 3 and "_smp_is_partial" not in both["model"]
    osd = smp.checkpoint.optimizer_to_torch(both["opt"], plain)
    assert osd["param_groups"] == want["opt"]["param_groups"]
    assert sorted(osd["state"]) == sorted(want["opt"]["state"])
    for i, s in want["opt"]["state"].items():
        for k, v in s.items():
            assert torch.equal(osd["state"][i][k], v), f"optimizer state {i}.{k} differs"
    popt = torch.optim.Adam(plain.parameters(), lr=0.01)
    popt.load_state_dict(osd)
    # A second save under the same name: its parts merge; a part of each save does not.
    _assert_same_state(smp.checkpoint.merge_partial([ck + ".twice_0", ck + ".twice_1"]),
                       want["later"], "second save")


def test_merge_errors_name_the_files(tmp_path, capsys):
    d = str(tmp_path)
    ck = d + "/ck.pt"
    _run(MERGE_SAVE, 2, tmp_path, dict(ckpt=ck, final=d + "/full.pt", opt="sgd",
                                       cfg={"partitions": 2, "microbatches": 2}))
    out = d + "/out.pt"

    def fails(*parts, words, process=False):
        # The command's own process for two cases; the others run its main() here (the
        # same code, without a fresh interpreter and torch import each: ~3 s apiece).
        if process:
            proc = _merge_cli(*parts, out)
            code, err = proc.returncode, proc.stderr
        else:
            from smp.checkpoint.merge import main
            capsys.readouterr()
            code, err = main(["merge", *parts, out]), capsys.readouterr().err
        assert code == 1, (code, err)
        for w in words:
            assert w in err, (w, err)
        assert "Traceback" not in err, err
        assert not os.path.exists(out)
        with pytest.raises(smp.CheckpointError):
            smp.checkpoint.merge_partial(list(parts))
        return err

    fails(ck + "_0", words=["missing part 1", f"'{ck}_1'"], process=True)
    fails(ck + "_0", ck + "_0", words=["part 0", "given twice"])
    fails(ck + "_0", ck + ".both_1", words=["parts of different checkpoints", f"'{ck}_0'",
                                            f"'{ck}.both_1'"])
    # Two saves of one name: the first save's part 0 beside the second save's part 1.
    os.mkdir(d + "/mixed")
    shutil.copy(ck + ".first_0", d + "/mixed/ck.pt_0")
    shutil.copy(ck + ".twice_1", d + "/mixed/ck.pt_1")
    fails(d + "/mixed/ck.pt_0", d + "/mixed/ck.pt_1",
          words=[f"parts of different saves of '{d}/mixed/ck.pt'", "mixed save ids"])
    # A corrupted part: checksums are verified before anything is merged.
    shutil.copy(ck + "_0", d + "/bad_0")
    shutil.copy(ck + "_1", d + "/bad_1")
    with open(d + "/bad_1", "r+b") as f:
        f.seek(1500)
        b = f.read(1)
        f.seek(1500)
        f.write(bytes([b[0] ^ 0x10]))
    fails(d + "/bad_0", d + "/bad_1", words=[f"'{d}/bad_1'", "checksum mismatch"], process=True)
    with open(d + "/bad_0", "r+b") as f:
        f.truncate(os.path.getsize(d + "/bad_0") - 10)
    fails(d + "/bad_0", ck + "_1", words=[f"'{d}/bad_0'", "truncated"])
    fails(d + "/nope_0", ck + "_1", words=[f"'{d}/nope_0'", "No such file"])
    smp.save({"v": 1}, d + "/full_file.pt", partial=False)
    fails(d + "/full_file.pt", ck + "_1", words=["is a full checkpoint", "torch.load"])


# --- weights_only, as torch.load (Note [smp.load and weights_only]) ----------------------

WEIGHTS_ONLY = r"""
import fractions, json, sys, torch, smp
opts = json.loads(sys.argv[1])
smp.init({"partitions": 2, "timeout_s": 30})
# pp rank 1's part holds an object no safe-globals list allows (a Fraction): weights-only
# unpickling refuses that part, and both ranks (rank 0 reads only its own part) raise
# the same error.
extra = {"frac": fractions.Fraction(1, 3)} if smp.pp_rank() == 1 else {}
smp.save({"w": torch.full((5,), float(smp.pp_rank())), **extra}, opts["ck"], partial=True)
for kw in ({}, {"weights_only": False}, {"weights_only": True}):
    try:
        got = smp.load(opts["ck"], partial=True, **kw)
        print("LOADED", kw, sorted(got), flush=True)
    except smp.CheckpointError as e:
        print("REFUSED", kw, e, flush=True)
"""


def test_weights_only_as_torch_load(tmp_path):
    from smp.ddp_comm_hooks import powerSGD_hook as psgd
    from torch_peer import LOAD_DEFAULTS_TO_WEIGHTS_ONLY
    d = str(tmp_path)
    # A real 2-rank partial save of tensors: weights-only unpickling loads it, equal.
    _run(SAVE2, 2, tmp_path, dict(dir=d, tags=["a"]))
    full = smp.load(d + "/a", partial=True)
    for kw in ({"weights_only": True}, {"pickle_module": None}):
        got = smp.load(d + "/a", partial=True, **kw)
        assert got.keys() == full.keys() and torch.equal(got["w"], full["w"]), kw
    # Model and optimizer state dicts (full file): weights only too.
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    ck = str(tmp_path / "full.pt")
    dicts = {"model": net.state_dict(), "opt": opt.state_dict()}
    smp.save(dicts, ck, partial=False)
    # The reference is torch.load(weights_only=True) of the same dicts in this run: 2.x
    # loads them; 1.13's weights-only unpickler knows no BINFLOAT (pickle opcode 71, the
    # optimizer's lr, betas, eps) and refuses them, and smp.load refuses them as it does.
    torch.save(dicts, str(tmp_path / "full_plain.pt"))
    try:
        torch.load(str(tmp_path / "full_plain.pt"), weights_only=True)
        torch_refuses = None
    except pickle.UnpicklingError as e:
        torch_refuses = re.search(r"WeightsUnpickler error: ([^\n]*)", str(e)).group(1)
    if torch_refuses is None:
        got = smp.load(ck, partial=False, weights_only=True)
        assert torch.equal(got["model"]["weight"], net.weight.detach())
        assert torch.equal(got["opt"]["state"][0]["exp_avg"], opt.state[net.weight]["exp_avg"])
    else:
        with pytest.raises(smp.CheckpointError) as e:
            smp.load(ck, partial=False, weights_only=True)
        assert str(e.value).startswith(f"smp.load: '{ck}' holds objects that weights_only=True "
                                       "refuses") and torch_refuses in str(e.value), \
            (str(e.value), torch_refuses)
        # SMP v1's default (full unpickling) still loads it.
        assert torch.equal(smp.load(ck, partial=False)["model"]["weight"], net.weight.detach())
    # smp's hook and its state load under every choice, weights_only=True included (Note
    # [Hook state loads weights-only] in smp/ddp_comm_hooks/_safe.py), in an smp file and
    # a plain torch.save one; the same with torch's own PowerSGDState is refused, naming
    # the file.
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as torch_psgd
    hooked = {"comm_hook": psgd.powerSGD_hook, "comm_hook_state": psgd.PowerSGDState(None)}
    smp.save(hooked, str(tmp_path / "hook.pt"), partial=False)
    torch.save(hooked, str(tmp_path / "plain.pt"))
    for name in ("hook.pt", "plain.pt"):
        path = str(tmp_path / name)
        for how in ({}, {"weights_only": True}, {"pickle_module": None}):
            got = smp.load(path, partial=False, **how)
            assert got["comm_hook"] is psgd.powerSGD_hook, (name, how)
            assert isinstance(got["comm_hook_state"], psgd.PowerSGDState), (name, how)
    theirs = str(tmp_path / "torch_hook.pt")
    torch.save({"comm_hook": torch_psgd.powerSGD_hook,
                "comm_hook_state": torch_psgd.PowerSGDState(None)}, theirs)
    with pytest.raises(smp.CheckpointError) as e:
        smp.load(theirs, partial=False, weights_only=True)
    msg = str(e.value)
    assert msg.startswith(f"smp.load: '{theirs}' holds objects that weights_only=True "
                          "refuses"), msg
    assert "Pass weights_only=False only for a file you trust" in msg, msg
    if LOAD_DEFAULTS_TO_WEIGHTS_ONLY:  # pickle_module=None: torch.load's default
        with pytest.raises(smp.CheckpointError, match="weights_only=True refuses"):
            smp.load(theirs, partial=False, pickle_module=None)
    # Bad arguments name the setting.
    with pytest.raises(ValueError, match=r"'weights_only'=1 is not one of \{None, True, False\}"):
        smp.load(ck, partial=False, weights_only=1)
    with pytest.raises(ValueError, match="weights_only=True .* pickle_module=.* is not the "
                                         "default pickle or None"):
        smp.load(ck, partial=False, weights_only=True, pickle_module=json)
    with pytest.raises(ValueError, match="'mmap'=True is not supported"):
        smp.load(ck, partial=False, mmap=True)
    # Two pp ranks, refused in one rank's part: both raise the same error.
    res = _run(WEIGHTS_ONLY, 2, tmp_path, dict(ck=str(tmp_path / "pp")))
    for r in res:
        lines = r.stdout.splitlines()
        assert lines[0] == "LOADED {} ['w']" and lines[1] == "LOADED {'weights_only': False} ['w']" \
            if r.rank == 0 else lines[0].startswith("LOADED {} ['frac', 'w']"), r
        assert lines[2].startswith(f"REFUSED {{'weights_only': True}} smp.load: "
                                   f"'{tmp_path}/pp_1' holds objects"), r
        assert lines[2].endswith("(pp rank 1)"), r
    assert res[0].stdout.splitlines()[2] == res[1].stdout.splitlines()[2]


# --- smp.save into a directory that does not exist -----------------------------------------

SAVE_MISSING_DIR = r"""
import json, os, sys, torch, smp
opts = json.loads(sys.argv[1])
smp.init({"partitions": 2, "timeout_s": 30})
for partial in (True, False):
    try:
        smp.save({"w": torch.ones(3)}, opts["dir"] + "/nope/ck", partial=partial)
        print("SAVED", flush=True)
    except smp.CheckpointError as e:
        print(f"ERROR partial={partial}:", e, flush=True)
# The job goes on: the ranks' collectives stayed in step.
smp.save({"w": torch.ones(3)}, opts["dir"] + "/ck", partial=True)
print("OK", flush=True)
"""


def test_save_into_missing_directory_says_what_to_do_on_every_rank(tmp_path):
    d = str(tmp_path)
    # 4 ranks, pp=2 x dp=2: the writers (dp rank 0) and the dp replicas that skip the write.
    res = _run(SAVE_MISSING_DIR, 4, tmp_path, dict(dir=d))
    want = (f"smp.save: directory '{d}/nope' does not exist (saving '{d}/nope/ck'): create it "
            f"before saving (os.makedirs('{d}/nope', exist_ok=True) on one rank, then "
            "smp.barrier()), or pass a file name in an existing directory")
    for r in res:
        lines = r.stdout.splitlines()
        assert lines == [f"ERROR partial=True: {want}", f"ERROR partial=False: {want}", "OK"], r
    assert sorted(p for p in os.listdir(d) if p.startswith("ck")) == ["ck_0", "ck_1"]
