"""Join for uneven inputs against torch DDP + torch Join, in the same run.

Every rank trains the same model twice on the same uneven data (dp rank r gets
4 + 2r batches unless a case says otherwise): once with torch DDP inside
`ddp.join()` over the dp process group, once with smp inside `model.join()` /
`smp.join.Join`, and compares every local parameter by name. With partitions=2 every
pp rank also runs the torch reference over its own dp group (one process per replica
in torch terms: the full model on each), and compares its own partition's parameters.
smp's PowerSGD with two buckets lands exactly where torch's hook does under torch's Join.
"""
import json
import re

import pytest


SCRIPT = r"""
import copy, json, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.algorithms.join import Join as TorchJoin
import smp
from smp.join import Join, Joinable, JoinHook

opts = json.loads(sys.argv[1])
pp = opts.get("partitions", 1)
smp.init({"ddp": True, "partitions": pp, "microbatches": opts.get("microbatches", 1),
          "pipeline": opts.get("pipeline", "interleaved")})
dp_rank, dp_size = smp.dp_rank(), smp.dp_size()
torch.manual_seed(0)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

counts = opts.get("counts") or [4 + 2 * r for r in range(dp_size)]
n_batches = counts[dp_rank]
gen = torch.Generator().manual_seed(100 + dp_rank)
data = [(torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen))
        for _ in range(n_batches)]
bucket_cap_mb = opts.get("bucket_cap_mb", 25)
divide = opts.get("divide", True)
pg = smp.get_dp_process_group()

base = Net()
ref = copy.deepcopy(base)
from torch_peer import ddp_bucketed_as_smp
ddp = ddp_bucketed_as_smp(ref, bucket_cap_mb, process_group=pg)  # smp's buckets on 1.13 too
hook = opts.get("hook")
PSGD = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=True,
            warm_start=True)
if hook == "fp16":
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as th
    ddp.register_comm_hook(pg, th.fp16_compress_hook)
elif hook == "powersgd":
    # torch's hook chains its allreduces from Gloo's callback threads, which with several
    # buckets aborts or hangs (torch_peer.POWERSGD_MANY_BUCKETS_ON_GLOO): each bucket's
    # chain is awaited before the next, which changes no value.
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps
    def awaited_powerSGD_hook(state, bucket):
        fut = tps.powerSGD_hook(state, bucket)
        fut.wait()
        return fut
    ddp.register_comm_hook(tps.PowerSGDState(process_group=pg, **PSGD), awaited_powerSGD_hook)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
if opts.get("torch_ref", True):
    with ddp.join(divide_by_initial_world_size=divide):
        for x, y in data:
            nn.functional.mse_loss(ddp(x), y).backward()
            ref_opt.step(); ref_opt.zero_grad()

src = copy.deepcopy(base)
opt = torch.optim.SGD(src.parameters(), lr=0.1)
model = smp.DistributedModel(src, bucket_cap_mb=bucket_cap_mb)
opt = smp.DistributedOptimizer(opt)
if hook == "fp16":
    model.register_comm_hook(pg, smp.ddp_comm_hooks.default_hooks.fp16_compress_hook)
elif hook == "powersgd":
    from smp.ddp_comm_hooks import powerSGD_hook as psgd
    state = psgd.PowerSGDState(process_group=pg, **PSGD)
    model.register_comm_hook(state, psgd.powerSGD_hook)

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

class Counter(Joinable):
    # A user joinable: counts this rank's steps; its hook adds the shadow iterations, so
    # every rank ends with the same total (an allreduce of its own each step).
    def __init__(self):
        super().__init__()
        self.total = torch.zeros(1)
        self.main_calls, self.post = 0, None
    def step(self):
        Join.notify_join_context(self)
        t = torch.ones(1); dist.all_reduce(t, group=pg); self.total += t
    def join_hook(self, **kwargs):
        me = self
        class H(JoinHook):
            def main_hook(self):
                me.main_calls += 1
                t = torch.zeros(1); dist.all_reduce(t, group=pg); me.total += t
            def post_hook(self, is_last_joiner):
                me.post = is_last_joiner
        return H()
    @property
    def join_device(self):
        return torch.device("cpu")
    @property
    def join_process_group(self):
        return pg

mode = opts.get("mode", "model")
counter = Counter()
if mode == "model":
    ctx = model.join(divide_by_initial_world_size=divide, enable=opts.get("enable", True),
                     throw_on_early_termination=opts.get("throw", False))
elif mode == "all":
    ctx = Join([model, opt, counter], divide_by_initial_world_size=divide)
else:
    ctx = Join([model, opt], divide_by_initial_world_size=divide)
try:
    with ctx:
        for x, y in data:
            train_step(x, y)
            opt.step(); opt.zero_grad()
            if mode == "all":
                counter.step()
except RuntimeError as e:
    if not opts.get("throw"):
        raise
    print("RAISED", str(e).splitlines()[0], flush=True)
    sys.exit(0)
assert not opts.get("throw"), "expected an early-termination error"
if mode == "all":
    expect = sum(counts)  # each active rank adds 1 per iteration over max(counts) iterations
    assert counter.total.item() == expect, (counter.total.item(), expect)
    assert counter.main_calls == max(counts) - n_batches, counter.main_calls
    assert counter.post == (n_batches == max(counts)), counter.post

# Every replica ends with the same parameters (the post hook's broadcast).
flat = torch.cat([p.detach().reshape(-1) for _, p in model.local_named_parameters()])
every = [torch.empty_like(flat) for _ in range(dp_size)]
dist.all_gather(every, flat, group=pg)
for r, other in enumerate(every):
    assert torch.equal(other, flat), f"dp rank {r} differs from dp rank {dp_rank}"

tol = opts.get("tol", 1e-5)
refp = dict(ref.named_parameters())
checked = 0
for name, p in model.local_named_parameters():
    torch.testing.assert_close(p, refp[name], rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    checked += 1
assert checked > 0
print("OK", checked, json.dumps(model._reducer.stats() if model._reducer else {}), flush=True)
"""


def _run(ranks, world, opts, **kw):
    return ranks(SCRIPT, world, args=(json.dumps(opts),), **kw)


def test_default_hook_matches_torch(ranks):
    _run(ranks, 2, {"bucket_cap_mb": 0.001})


def test_divide_by_active_ranks_matches_torch(ranks):
    _run(ranks, 2, {"divide": False})


def test_fp16_hook_matches_torch(ranks):
    _run(ranks, 2, {"hook": "fp16", "tol": 1e-3, "bucket_cap_mb": 0.001})


def test_powersgd_under_join(ranks):
    # Several buckets, uneven inputs: against torch DDP + Join + torch's hook (awaited per
    # bucket, see the script); the shadow steps of the joined rank run the hook's chain.
    res = _run(ranks, 2, {"hook": "powersgd", "bucket_cap_mb": 0.001})
    assert all("OK" in r.stdout for r in res)


def test_model_optimizer_and_user_joinable(ranks):
    _run(ranks, 2, {"mode": "all"})


def test_four_ranks_three_batch_counts(ranks):
    _run(ranks, 4, {"counts": [3, 5, 5, 7], "mode": "optimizer"})


def test_rank_with_zero_batches(ranks):
    _run(ranks, 2, {"counts": [0, 3]})


def test_enable_false_even_inputs(ranks):
    _run(ranks, 2, {"counts": [3, 3], "enable": False})


_EXHAUSTED = "Rank 0 exhausted all inputs."  # torch's texts (1.13 and 2.15 alike)
_DETECTED = "Detected at least one rank that exhausted inputs. Throwing across all ranks."


def test_throw_on_early_termination(ranks):
    # dp rank 0 has 4 batches, dp rank 1 has 6: rank 0 runs out first.
    res = _run(ranks, 2, {"throw": True, "torch_ref": False})
    lines = [r.stdout.split("RAISED", 1)[1].strip() for r in res]
    assert lines == [_EXHAUSTED, _DETECTED], lines


def test_throw_on_early_termination_pipeline(ranks):
    # pp=2 x dp=2: replica 0 (ranks 0, 1; dp rank 0) runs out; both its pp ranks raise
    # the exhausted text, both ranks of replica 1 the detected one.
    res = _run(ranks, 4, {"throw": True, "torch_ref": False, "partitions": 2})
    lines = [r.stdout.split("RAISED", 1)[1].strip() for r in res]
    assert lines == [_EXHAUSTED, _EXHAUSTED, _DETECTED, _DETECTED], lines


@pytest.mark.parametrize("pipeline", ["interleaved", "zero_bubble"])
def test_pipeline_two_by_two_uneven(ranks, pipeline):
    # zero_bubble: the shadow steps of a joined replica run beside planned steps whose
    # weight halves are deferred (Note [Zero bubble at run time]).
    res = _run(ranks, 4, {"partitions": 2, "microbatches": 2, "pipeline": pipeline})
    if pipeline == "zero_bubble":
        assert "executing the pipeline plan zero_bubble" in res[0].stderr, res[0]


UNEVEN_WITHOUT_JOIN = r"""
import torch, torch.nn as nn
import smp
smp.init({"partitions": 2, "ddp": True, "timeout_s": 120})
torch.manual_seed(0)
model = smp.DistributedModel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
@smp.step
def step(x):
    loss = model(x).sum()
    model.backward(loss)
    return loss
try:
    for _ in range(2 + smp.dp_rank()):  # replica 0 (ranks 0, 1) has one batch less
        step(torch.randn(4, 4)); opt.step(); opt.zero_grad()
    print("done", flush=True)
except smp.CommError as e:
    print("RAISED", e, flush=True)
"""


def test_uneven_inputs_without_join_name_global_ranks_and_suggest_join(ranks):
    # pp=2 x dp=2: dp groups {0, 2} and {1, 3}, so rank 1 is rank 0 of its dp group.
    res = ranks(UNEVEN_WITHOUT_JOIN, 4, check=False)
    assert [r.stdout.strip() for r in res[:2]] == ["done", "done"], res[:2]
    for r, gone in ((res[2], 0), (res[3], 1)):
        text = r.stdout.split("RAISED ", 1)[1].strip()
        assert re.fullmatch(
            re.escape("smp: bucket 0 of 1 (shared memory) on the dp process group (gloo, rank 1 "
                      f"of 2) in step 3 failed: rank {gone} (pid ") + r"\d+" +
            re.escape(", rank 0 of the group) exited without reaching it (shared-memory "
                      f"reduction, on rank {r.rank}) (if the ranks have different numbers of "
                      "batches (uneven inputs), train inside `with model.join():` or `with "
                      "smp.join.Join([model, optimizer]):`)"), text), (r.rank, text)
