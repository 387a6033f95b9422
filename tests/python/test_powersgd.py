"""smp's C++ PowerSGD hooks (smp.ddp_comm_hooks.powerSGD_hook) on real Gloo ranks.

- Parity: 2 ranks, the same seed: smp.DistributedModel + smp's hook against torch DDP +
  torch's own powerSGD_hook in the same processes, >= 10 compressed steps; one bucket,
  and several (torch's hook awaited per bucket where it does not survive Gloo there,
  torch_peer.POWERSGD_MANY_BUCKETS_ON_GLOO).
- Many buckets (tiny bucket_cap_mb), 2 and 4 ranks, both hooks, 20 jobs in a row: no
  failure (torch's hook aborts intermittently on Gloo there, FACTS.md), replicas
  identical, loss falls; the compression stats equal the bytes sent.
- Resume: the hook state saved mid-training with torch.save continues exactly (==).
- Bad input raises on every rank, naming the argument.
"""
import json
import os

import pytest

NET = r"""
import torch, torch.nn as nn
from nets import Net  # tests/python/nets.py
"""

PARITY = NET + r"""
import copy, json, sys
import torch.distributed as dist
import smp
from smp.ddp_comm_hooks import powerSGD_hook as smp_psgd
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as th_psgd

opts = json.loads(sys.argv[1])
smp.init({"ddp": True})
rank = smp.rank()
pg = smp.get_dp_process_group()
torch.manual_seed(0)
base = Net()
kw = dict(matrix_approximation_rank=opts.get("rank", 1), start_powerSGD_iter=opts.get("start", 2),
          min_compression_rate=opts.get("rate", 2), warm_start=opts.get("warm", True),
          use_error_feedback=opts.get("ef", True), random_seed=opts.get("seed", 0),
          batch_tensors_with_same_shape=opts.get("same", False))
bpps = opts.get("bpps", 1)
view = opts.get("view", False)
cap = opts.get("cap", 25)

def awaited_powerSGD_hook(state, bucket):
    fut = th_psgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut

from torch_peer import POWERSGD_MANY_BUCKETS_ON_GLOO
# Several buckets: torch's hook as it is where it survives Gloo, else each bucket's chain
# awaited before the next (which changes no value).
th_hook = th_psgd.powerSGD_hook if cap == 25 or POWERSGD_MANY_BUCKETS_ON_GLOO \
    else awaited_powerSGD_hook
ref = copy.deepcopy(base)
from torch_peer import ddp_bucketed_as_smp
ddp = ddp_bucketed_as_smp(ref, cap, process_group=pg, gradient_as_bucket_view=view)
ddp.register_comm_hook(th_psgd.PowerSGDState(process_group=pg, **kw), th_hook)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)

src = copy.deepcopy(base)
opt = smp.DistributedOptimizer(torch.optim.SGD(src.parameters(), lr=0.05))
model = smp.DistributedModel(src, gradient_as_bucket_view=view, backward_passes_per_step=bpps,
                             bucket_cap_mb=cap)
state = smp_psgd.PowerSGDState(None, **kw)
model.register_comm_hook(state, smp_psgd.powerSGD_hook)

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

gen = torch.Generator().manual_seed(100 + rank)
steps = opts.get("steps", 14)
for step in range(steps):
    for micro in range(bpps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        if micro < bpps - 1:
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(x), y).backward()
        else:
            nn.functional.mse_loss(ddp(x), y).backward()
        train_step(x, y)
    ref_opt.step(); ref_opt.zero_grad()
    opt.step(); opt.zero_grad()

buckets = len(model._reducer.bucket_indices())
assert buckets == 1 if cap == 25 else buckets >= 2, model._reducer.bucket_indices()
assert state.iter == steps and state.iter >= state.start_powerSGD_iter + 10
worst = 0.0
for (name, p), q in zip(model.named_parameters(), ref.parameters()):
    worst = max(worst, (p - q).abs().max().item())
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
print("max_abs_diff", worst, "buckets", buckets)
"""

PARITY_CASES = {
    "default": {},
    "rank2_seed7_bucket_view": {"rank": 2, "seed": 7, "view": True},
    "rank3_qr_no_warm_start": {"rank": 3, "warm": False, "ef": False, "start": 1},
    "same_shape_batched_bpps2": {"same": True, "bpps": 2},
    "many_buckets": {"cap": 0.001, "rank": 2},
}


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_parity_with_torch_powersgd(ranks, case):
    res = ranks(PARITY, 2, args=(json.dumps(PARITY_CASES[case]),))
    print(case, res[0].stdout.strip())


# Several trainings per job: each a fresh DistributedModel is not allowed per process,
# so a job trains one model; the loop runs jobs in fresh processes.
LOOP = NET + r"""
import json, sys
import smp
from smp.ddp_comm_hooks import powerSGD_hook as psgd
from smp.ddp_comm_hooks.default_hooks import fp16_compress_wrapper, bf16_compress_wrapper

opts = json.loads(sys.argv[1])
smp.init({"ddp": True})
rank, world = smp.rank(), smp.size()
torch.manual_seed(0)
net = Net()
opt = smp.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01))
model = smp.DistributedModel(net, bucket_cap_mb=opts.get("cap", 0.0001),
                             gradient_as_bucket_view=opts.get("view", False))
state = psgd.PowerSGDState(None, matrix_approximation_rank=opts.get("rank", 1),
                           start_powerSGD_iter=2, min_compression_rate=opts.get("rate", 2),
                           random_seed=3)  # the same on every rank: Q must agree
hook = psgd.batched_powerSGD_hook if opts["hook"] == "batched" else psgd.powerSGD_hook
if opts.get("wrap") == "fp16":
    hook = fp16_compress_wrapper(hook)
elif opts.get("wrap") == "bf16":
    hook = bf16_compress_wrapper(hook)
model.register_comm_hook(state, hook)

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

gen = torch.Generator().manual_seed(7)  # one fixed regression task for every rank
w_true = torch.randn(8, 4, generator=gen)
data = torch.Generator().manual_seed(100 + rank)
x = torch.randn(32, 8, generator=data)  # one batch per rank: the loss falls steadily
losses, bytes_at_start = [], None
for step in range(opts.get("steps", 12)):
    if step == 2:
        bytes_at_start = state.bytes_allreduced()
    losses.append(train_step(x, x @ w_true).reduce_mean().item())
    opt.step(); opt.zero_grad()

nb = len(model._reducer.bucket_indices())
assert nb >= opts.get("min_buckets", 2), nb
# Replicas identical, bit for bit.
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
allp = smp.allgather(flat, smp.CommGroup.DP_GROUP)
assert all(torch.equal(allp[0], t) for t in allp), "replicas differ"
assert sum(losses[-3:]) < 0.85 * sum(losses[:3]), losses
# Compression stats: what the compressed steps sent, element for element.
rate, before, after = state.compression_stats()
elem = 2 if opts.get("wrap") else 4
compressed = opts.get("steps", 12) - 2
numel = sum(p.numel() for p in model.parameters())
assert before == compressed * numel, (before, compressed, numel)
assert (state.bytes_allreduced() - bytes_at_start) == after * elem, \
    (state.bytes_allreduced() - bytes_at_start, after, elem)
print("result", json.dumps({"buckets": nb, "rate": rate, "loss0": losses[0], "loss": losses[-1]}))
"""

LOOP_JOBS = [(2, {"hook": "psgd"}), (2, {"hook": "batched"}),
             (4, {"hook": "psgd"}), (4, {"hook": "batched", "view": True})]

# Five independent trainings per launch, each on a fresh Gloo group with a fresh
# Reducer and PowerSGDState (what a new job has at the communication level); four
# launches make 20 jobs. Process start-up dominates on 2 cores, so 20 fresh-process
# jobs (SMP_POWERSGD_PROCESS_JOBS=20) are opt-in.
JOBS = NET + r"""
import json, sys
import torch.distributed as dist
import smp
from smp.ddp_comm_hooks import powerSGD_hook as psgd

opts = json.loads(sys.argv[1])
smp.init({"ddp": True})
rank, world = smp.rank(), smp.size()
w_true = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
for job in range(opts.get("jobs", 5)):
    g = dist.new_group(list(range(world)))  # fresh Gloo connections
    torch.manual_seed(job)
    net = Net()
    params = list(net.parameters())
    red = smp._C.Reducer(params, g, bucket_cap_mb=0.0001, timeout_s=30,
                         gradient_as_bucket_view=opts.get("view", False))
    state = psgd.PowerSGDState(None, start_powerSGD_iter=2, random_seed=job)
    red.register_comm_hook(state, psgd.batched_powerSGD_hook if opts["hook"] == "batched"
                           else psgd.powerSGD_hook)
    opt = torch.optim.Adam(params, lr=0.01)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(100 + 10 * job + rank))
    losses = []
    for step in range(10):
        loss = nn.functional.mse_loss(net(x), x @ w_true)
        red.prepare_for_backward(True, 1.0, [loss])
        loss.backward()
        red.finalize()
        opt.step(); opt.zero_grad()
        losses.append(loss.item())
    nb = len(red.bucket_indices())
    assert nb >= 6, nb
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    allp = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(allp, flat, group=g)
    assert all(torch.equal(allp[0], t) for t in allp), f"job {job}: replicas differ"
    assert losses[-1] < 0.95 * losses[0], (job, losses)
    assert state.iter == 10 and state.compression_stats()[1] == 8 * flat.numel()
    del red
    print("job", job, "buckets", nb, "loss", losses[0], "->", losses[-1], flush=True)
"""


@pytest.mark.parametrize("world,opts", LOOP_JOBS, ids=["2_psgd", "2_batched", "4_psgd",
                                                       "4_batched_view"])
def test_many_buckets_twenty_jobs_never_fail(ranks, world, opts):
    """4 launches x 5 jobs: 2 and 4 ranks, both hooks, ~40 buckets each; all must pass."""
    res = ranks(JOBS, world, args=(json.dumps(opts),), timeout=90)
    assert res[0].stdout.count("job ") == 5, res[0].stdout


@pytest.mark.skipif(not os.environ.get("SMP_POWERSGD_PROCESS_JOBS"),
                    reason="slow: set SMP_POWERSGD_PROCESS_JOBS=20 for fresh-process jobs")
def test_many_buckets_fresh_process_jobs(tmp_path):
    from conftest import run_ranks
    failures = []
    for i in range(int(os.environ["SMP_POWERSGD_PROCESS_JOBS"])):
        world, opts = LOOP_JOBS[i % len(LOOP_JOBS)]
        res = run_ranks(LOOP, world, tmp_path, args=(json.dumps(opts),), timeout=90)
        bad = [r for r in res if r.returncode != 0]
        if bad:
            failures.append((i, world, opts, bad))
    assert not failures, "\n".join(f"job {i} world {w} {o}: {b}" for i, w, o, b in failures)


@pytest.mark.parametrize("opts", [
    {"hook": "psgd", "wrap": "fp16"},
    {"hook": "psgd", "wrap": "bf16", "rate": 0.5},
    {"hook": "batched", "wrap": "fp16", "view": True},
    {"hook": "psgd", "rank": 4, "rate": 0.5, "cap": 25, "min_buckets": 1},
], ids=["fp16_wrapper", "bf16_wrapper_biases_too", "batched_fp16_view", "rank4_qr_one_bucket"])
def test_composes_with_wrappers_and_options(ranks, opts):
    ranks(LOOP, 2, args=(json.dumps(opts),))


PIPELINE = r"""
import torch, torch.nn as nn
import smp
from smp.ddp_comm_hooks import powerSGD_hook as psgd

smp.init({"partitions": 2, "microbatches": 2, "ddp": True})
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                    nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
with torch.no_grad():  # the dp replicas start apart: the first step aligns them
    for p in net.parameters():
        p.add_(0.01 * smp.dp_rank())
opt = smp.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01))
model = smp.DistributedModel(net, bucket_cap_mb=0.0001)
state = psgd.PowerSGDState(None, start_powerSGD_iter=2)
model.register_comm_hook(state, psgd.powerSGD_hook)

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

w_true = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
data = torch.Generator().manual_seed(100 + smp.dp_rank())
x = torch.randn(32, 8, generator=data)
losses = []
for step in range(10):
    losses.append(train_step(x, x @ w_true).reduce_mean().item())
    opt.step(); opt.zero_grad()
# Each partition's dp group ran its own PowerSGD on its own parameters.
# None became the dp group at registration.
assert state.iter == 10 and state.process_group is smp.get_dp_process_group()
assert state.compression_stats()[1] == 8 * sum(p.numel() for p in model.local_parameters())
flat = torch.cat([p.detach().reshape(-1) for p in model.local_parameters()])
allp = smp.allgather(flat, smp.CommGroup.DP_GROUP)
assert all(torch.equal(allp[0], t) for t in allp), "dp replicas differ"
assert sum(losses[-3:]) < 0.85 * sum(losses[:3]), losses
print("ok", smp.pp_rank(), len(model._reducer.bucket_indices()))
"""


def test_partitions_each_dp_group_runs_its_own(ranks):
    ranks(PIPELINE, 4, timeout=120)


RESUME = NET + r"""
import json, os, sys
import smp
from smp.ddp_comm_hooks import powerSGD_hook as psgd

phase, ckpt, hook_name = sys.argv[1], sys.argv[2], sys.argv[3]
# way: the state saved as the object ("pickle"), as its state_dict() loaded into a
# fresh state, or by smp.save_checkpoint ("checkpoint"); buckets: one bucket or one per parameter; momentum: SGD's, saved with
# the optimizer's state.
way, buckets, momentum, pp = sys.argv[4], sys.argv[5], float(sys.argv[6]), int(sys.argv[7])
# way "checkpoint": smp.save_checkpoint into the job's checkpoint directory, which the
# second job resumes from by itself (each rank's hook state in its progress record).
ckdir = f"{ckpt}_dir"
smp.init({"ddp": True, "partitions": pp, "microbatches": pp,
          **({"checkpoint_dir": ckdir} if way == "checkpoint" else {})})
rank = smp.rank()
torch.manual_seed(0)
net = Net()
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=momentum))
model = smp.DistributedModel(net, bucket_cap_mb=0.001 if buckets == "many" else 25)
save_at, steps = 5, 12
options = dict(start_powerSGD_iter=3, warm_start=hook_name == "psgd", use_error_feedback=True,
               random_seed=11, matrix_approximation_rank=2)
hook = psgd.powerSGD_hook if hook_name == "psgd" else psgd.batched_powerSGD_hook
if phase == "first" or way == "checkpoint":
    state = psgd.PowerSGDState(None, **options)
    model.register_comm_hook(state, hook)
    start = 0  # the second "checkpoint" job fast-forwards to the save by itself
else:
    # smp's hook and state load weights-only; a state_dict() holds torch's numpy
    # RandomState, as torch's does.
    ck = torch.load(f"{ckpt}.{rank}", weights_only=way == "pickle")
    model.load_state_dict(ck["state_dict"])
    opt.load_state_dict(ck["opt"])
    if way == "pickle":
        state = ck["comm_hook_state"]
        assert state.process_group is smp.get_dp_process_group()
    else:
        state = psgd.PowerSGDState(None, **options)
        state.load_state_dict(ck["comm_hook_state"])
    model.register_comm_hook(state, ck["comm_hook"])
    start = save_at

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

gen = torch.Generator().manual_seed(100 + rank)
batches = [(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen))
           for _ in range(steps)]
for step in range(start, steps):
    if phase == "first" and step == save_at and way == "checkpoint":
        smp.save_checkpoint(ckdir, f"s{step}", partial=True)
    elif phase == "first" and step == save_at:
        torch.save({"state_dict": model.state_dict(), "opt": opt.state_dict(),
                    "comm_hook": hook,
                    "comm_hook_state": state if way == "pickle" else state.state_dict()},
                   f"{ckpt}.{rank}")
    train_step(*batches[step])
    opt.step(); opt.zero_grad()
final = {n: p.detach().clone() for n, p in model.named_parameters()}
if phase == "first":
    torch.save(final, f"{ckpt}.final.{rank}")
else:
    want = torch.load(f"{ckpt}.final.{rank}")
    for n, p in final.items():
        assert torch.equal(p, want[n]), f"{n} differs after resume: {(p - want[n]).abs().max()}"
    assert state.iter == steps
    print("resumed exactly")
"""


# Each hook under each way of saving (the object, its state_dict(), smp.save_checkpoint),
# both bucket counts and both layouts of ranks, in 7 chosen combinations.
@pytest.mark.parametrize("hook,way,buckets,momentum,pp", [
    ("psgd", "pickle", "one", "0.9", 1), ("batched", "state_dict", "one", "0.9", 1),
    ("psgd", "state_dict", "many", "0.9", 1), ("batched", "pickle", "one", "0.9", 2),
    ("psgd", "state_dict", "one", "0.9", 2), ("batched", "checkpoint", "many", "0", 1),
    ("psgd", "checkpoint", "one", "0.9", 2)])
def test_resume_from_torch_save_is_exact(ranks, tmp_path, hook, way, buckets, momentum, pp):
    # Note [Hook state carries its layout] (smp/ddp_comm_hooks/powerSGD_hook.py): a
    # state saved by hand after compression started (step 3) resumes bitwise, saved as
    # the object or as its state_dict(), on one bucket (whose first step on a fresh
    # model used to follow torch's constructor order: 3.8e-3 off) and on many, at pp=1
    # and pp=2 x dp=2 (each rank's state over its partition).
    ckpt = str(tmp_path / "ckpt")
    args = (ckpt, hook, way, buckets, momentum, str(pp))
    ranks(RESUME, 2 * pp, args=("first",) + args)  # pp=2: 2 x dp=2
    res = ranks(RESUME, 2 * pp, args=("second",) + args)
    assert all("resumed exactly" in r.stdout for r in res)


BAD = NET + r"""
import pickle, torch.distributed as dist
import smp
from smp.ddp_comm_hooks import powerSGD_hook as psgd

smp.init({"ddp": True})
rank = smp.rank()

def raises(exc, text, fn):
    try:
        fn()
    except exc as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError(f"no {exc.__name__} for {text}")

raises(smp.ConfigError, "smp: PowerSGDState matrix_approximation_rank=0 must be >= 1",
       lambda: psgd.PowerSGDState(None, matrix_approximation_rank=0))
raises(ValueError, "smp: PowerSGDState start_powerSGD_iter=1 must be > 1 when "
       "use_error_feedback or warm_start is on",
       lambda: psgd.PowerSGDState(None, start_powerSGD_iter=1))
raises(ValueError, "start_powerSGD_iter=0", lambda: psgd.PowerSGDState(None, start_powerSGD_iter=0,
                                                                    use_error_feedback=False))
psgd.PowerSGDState(None, start_powerSGD_iter=1, error_feedback=False, warm_start=False)
raises(ValueError, "random_seed=-1", lambda: psgd.PowerSGDState(None, random_seed=-1))

# State and hook pickle; the alias and torch's attribute names work.
st = psgd.PowerSGDState(None, start_powerSGD_iter=3, error_feedback=False, random_seed=5)
assert st.use_error_feedback is False and st.start_powerSGD_iter == 3 and st.iter == 0
st2 = pickle.loads(pickle.dumps(st))
assert st2.process_group is smp.get_dp_process_group() and st2.random_seed == 5
assert st2.rng.randint(1_000_000_000) == __import__("numpy").random.RandomState(5).randint(1_000_000_000)
h = pickle.loads(pickle.dumps(psgd.powerSGD_hook))
assert h == psgd.powerSGD_hook and h.__name__ == "powerSGD_hook"
assert psgd.batched_powerSGD_hook.__qualname__ == "batched_powerSGD_hook"

# A process group is not a PowerSGDState.
red = smp._C.Reducer([torch.zeros(3, requires_grad=True)], smp.get_dp_process_group())
raises(ValueError, "powerSGD_hook takes an smp.ddp_comm_hooks.powerSGD_hook.PowerSGDState",
       lambda: red.register_comm_hook(smp.get_dp_process_group(), psgd.powerSGD_hook))
del red

# Non-float gradients: a complex parameter, refused on every rank with the dtype named.
z = torch.zeros(4, 4, dtype=torch.complex64, requires_grad=True)
red = smp._C.Reducer([z], smp.get_dp_process_group(), timeout_s=20)
red.register_comm_hook(psgd.PowerSGDState(None, start_powerSGD_iter=2), psgd.powerSGD_hook)
loss = (z * z).abs().sum()
red.prepare_for_backward(True, 1.0, [loss])
loss.backward()
raises(smp.CommError, "holds ComplexFloat gradients; PowerSGD compresses only floating-point",
       red.finalize)
del red

# The model: registered twice, or after the first step.
model = smp.DistributedModel(Net())
state = psgd.PowerSGDState(None, start_powerSGD_iter=2)
model.register_comm_hook(state, psgd.powerSGD_hook)
raises(RuntimeError, "register_comm_hook must be called once, before the first step",
       lambda: model.register_comm_hook(state, psgd.powerSGD_hook))

@smp.step
def train_step(x):
    loss = model(x).sum()
    model.backward(loss)
    return loss
train_step(torch.randn(4, 8))
raises(RuntimeError, "register_comm_hook must be called once, before the first step",
       lambda: model.register_comm_hook(state, psgd.powerSGD_hook))
print("bad inputs ok")
"""


def test_bad_inputs_raise_on_every_rank(ranks):
    res = ranks(BAD, 2)
    assert all("bad inputs ok" in r.stdout for r in res)


# The end-to-end example of torch's comm-hook docs (docs/ddp_comm_hooks.rst: rank 0
# saves the model, the hook and its state with torch.save; every rank loads them into
# a fresh model), trained before and after the reload, with torch's names on torch DDP
# and smp's names on smp, in the same processes.
SEED_EXAMPLE = r"""
import pickle, sys
import torch, torch.nn as nn, torch.optim as optim, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
import smp
from smp.ddp_comm_hooks import powerSGD_hook as smp_powerSGD

class SimpleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(24, 24)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(24, 12)
    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))

phase, ckpt = sys.argv[1], sys.argv[2]
smp.init({"ddp": True})
rank = smp.rank()
torch.manual_seed(0)
gen = torch.Generator().manual_seed(10 + rank)
data = [(torch.randn(8, 24, generator=gen), torch.randn(8, 12, generator=gen)) for _ in range(10)]
data = data[:5] if phase == "first" else data[5:]

if phase == "first":
    model = SimpleModel()
    ddp_model = DistributedDataParallel(model)
    state = powerSGD.PowerSGDState(process_group=None, start_powerSGD_iter=2)
    ddp_model.register_comm_hook(state, powerSGD.powerSGD_hook)
    smp_model = smp.DistributedModel(SimpleModel())
    smp_model.load_state_dict(model.state_dict())
    smp_state = smp_powerSGD.PowerSGDState(process_group=None, start_powerSGD_iter=2)
    smp_model.register_comm_hook(smp_state, smp_powerSGD.powerSGD_hook)
else:
    # torch's hook and state need full pickle (torch >= 2.6 refuses them by default);
    # smp's load with torch.load's default (Note [Hook state loads weights-only]).
    if torch.__version__ >= "2.6":
        try:
            torch.load(f"{ckpt}.torch")
            raise SystemExit("torch's PowerSGDState loaded weights-only")
        except pickle.UnpicklingError as e:
            print("TORCH_REFUSED", "PowerSGDState" in str(e) or "powerSGD" in str(e))
    checkpoint = torch.load(f"{ckpt}.torch", weights_only=False)
    ddp_model = DistributedDataParallel(SimpleModel())
    ddp_model.load_state_dict(checkpoint["state_dict"])
    ddp_model.register_comm_hook(checkpoint["comm_hook_state"], checkpoint["comm_hook"])
    state = checkpoint["comm_hook_state"]
    checkpoint = torch.load(f"{ckpt}.smp")
    smp_model = smp.DistributedModel(SimpleModel())
    smp_model.load_state_dict(checkpoint["state_dict"])
    smp_model.register_comm_hook(checkpoint["comm_hook_state"], checkpoint["comm_hook"])
    smp_state = checkpoint["comm_hook_state"]
optimizer = optim.SGD(ddp_model.parameters(), lr=0.1)
smp_optimizer = smp.DistributedOptimizer(optim.SGD(smp_model.parameters(), lr=0.1))

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(smp_model(x), y)
    smp_model.backward(loss)
    return loss

for x, y in data:
    nn.functional.mse_loss(ddp_model(x), y).backward()
    optimizer.step(); optimizer.zero_grad()
    train_step(x, y)
    smp_optimizer.step(); smp_optimizer.zero_grad()
assert state.iter == smp_state.iter == (5 if phase == "first" else 10)
worst = max((p - q).abs().max().item()
            for p, q in zip(ddp_model.module.parameters(), smp_model.parameters()))
print(phase, "max_abs_diff", worst, flush=True)
if phase == "first":  # the same hook on the same layouts: where torch lands
    assert worst <= 1e-6, worst
else:
    # After the reload smp's state brings the layout it is indexed by (Note [Hook state
    # carries its layout]); torch applies it to its constructor's layout for a step, so
    # the two part. The replicas stay equal.
    flat = torch.cat([p.detach().reshape(-1) for p in smp_model.parameters()])
    assert all(torch.equal(flat, t) for t in smp.allgather(flat, smp.CommGroup.DP_GROUP))
if phase == "first":
    if rank == 0:
        torch.save({"state_dict": ddp_model.state_dict(), "comm_hook": powerSGD.powerSGD_hook,
                    "comm_hook_state": state}, f"{ckpt}.torch")
        torch.save({"state_dict": smp_model.state_dict(),
                    "comm_hook": smp_powerSGD.powerSGD_hook, "comm_hook_state": smp_state},
                   f"{ckpt}.smp")
    dist.barrier()
"""


def test_seed_example_runs_and_reloads(ranks, tmp_path):
    # Before the reload smp shows hooks torch's bucket layouts (Note [Hook buckets follow
    # torch's] in smp_core/detail/reducer_rebuild.cpp) and lands where torch does. After
    # it, torch's first step meets its constructor's layout with state saved in the
    # rebuilt one, while smp's state brings its own (Note [Hook state carries its
    # layout]): the exact resume is test_resume_from_torch_save_is_exact's.
    # The example loads smp's hook and state with torch.load's default, weights-only
    # since torch 2.6 (Note [Hook state loads weights-only]); torch's own are refused.
    from torch_peer import LOAD_DEFAULTS_TO_WEIGHTS_ONLY
    ckpt = str(tmp_path / "checkpoint.pt")
    for phase in ("first", "second"):
        res = ranks(SEED_EXAMPLE, 2, args=(phase, ckpt))
        print(res[0].stdout.strip())
        if phase == "second" and LOAD_DEFAULTS_TO_WEIGHTS_ONLY:
            assert all("TORCH_REFUSED True" in r.stdout for r in res), res
