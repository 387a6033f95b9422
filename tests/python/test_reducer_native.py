"""smp._C.Reducer used directly, against torch's DistributedDataParallel in the same run.

Each case trains the same MLP twice in the same 2 Gloo ranks with different data per
rank: once with torch DDP, once with smp._C.Reducer (prepare_for_backward, backward,
finalize), and compares every parameter.
"""
import json

import pytest

SCRIPT = r"""
import collections, copy, json, sys
import torch, torch.distributed as dist, torch.nn as nn
import smp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as th

opts = json.loads(sys.argv[1])
torch.set_num_threads(1)
smp.init()
rank, world = smp.rank(), smp.size()
pg = smp.get_dp_process_group()
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.spare = nn.Linear(32, 4)

    def forward(self, x, use_spare=False):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.spare(h) if use_spare else self.head(h)


base = Net()
ref = copy.deepcopy(base)
mine = copy.deepcopy(base)
cap = opts.get("bucket_cap_mb", 25.0)
view = opts.get("gradient_as_bucket_view", False)
unused = opts.get("unused", False)
ddp = nn.parallel.DistributedDataParallel(ref, process_group=pg, bucket_cap_mb=cap,
                                          gradient_as_bucket_view=view,
                                          find_unused_parameters=True)
if opts.get("hook") == "fp16":
    ddp.register_comm_hook(pg, th.fp16_compress_hook)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

params = list(mine.parameters())
if rank == 1:  # replicas start apart: broadcast_coalesced must align them
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
smp._C.broadcast_coalesced(pg, params, 0)
red = smp._C.Reducer(params, pg, bucket_cap_mb=cap, gradient_as_bucket_view=view,
                     overlapping=opts.get("overlapping", True),
                     expected_order=opts.get("expected_order"), timeout_s=60.0,
                     shared_memory=opts.get("shared_memory", True))
# Both ranks run on this host: buckets are summed in shared memory unless turned off.
assert red.shared_memory() == opts.get("shared_memory", True)
calls = collections.Counter()
step_no = 0
if opts.get("hook") == "fp16":
    red.register_comm_hook(pg, smp._C.fp16_compress_hook)
elif opts.get("hook") == "python":
    def counting_hook(state, bucket):
        calls[(step_no, bucket.index())] += 1
        assert [tuple(g.shape) for g in bucket.gradients()] == \
            [tuple(p.shape) for p in bucket.parameters()]
        fut = dist.all_reduce(bucket.buffer().div_(world), group=state, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    red.register_comm_hook(pg, counting_hook)
elif opts.get("hook") == "torch_powersgd":
    # torch's own Python PowerSGD chains two allreduces per bucket from future
    # callbacks; with several buckets torch DDP on Gloo aborts intermittently (FACTS.md).
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    state = psgd.PowerSGDState(process_group=pg, matrix_approximation_rank=1,
                               start_powerSGD_iter=2, min_compression_rate=0.5)
    red.register_comm_hook(state, psgd.powerSGD_hook)
opt = torch.optim.SGD(params, lr=0.1)
set_to_none = opts.get("set_to_none", False)

gen = torch.Generator().manual_seed(100 + rank)
layouts = []
for step_no in range(opts.get("steps", 5)):
    use_spare = unused and step_no % 2 == 1 and rank == 0
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    nn.functional.mse_loss(ddp(x, use_spare), y).backward()
    layouts.append(red.bucket_indices())
    loss = nn.functional.mse_loss(mine(x, use_spare), y)
    red.prepare_for_backward(True, 1.0, [loss])
    loss.backward()
    red.finalize()
    if view:
        # Gradients live in the buckets: consecutive parameters of a bucket are adjacent.
        for bucket in red.bucket_indices():
            grads = [params[i].grad for i in bucket if params[i].grad is not None]
            for a, b in zip(grads, grads[1:]):
                assert b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
    ref_opt.step(); ref_opt.zero_grad(set_to_none=set_to_none)
    opt.step(); opt.zero_grad(set_to_none=set_to_none)

tol = opts.get("tol", 1e-5)
if opts.get("hook") == "torch_powersgd":  # lossy: the replicas must agree, not match DDP
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    other = flat.clone()
    dist.broadcast(other, 0, group=pg)
    assert torch.equal(flat, other), "replicas diverged"
    assert not torch.equal(flat, torch.cat([q.detach().reshape(-1) for q in base.parameters()]))
else:
    for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
if not unused:
    assert mine.spare.weight.grad is None, "unused everywhere: .grad must stay None"
if opts.get("hook") == "python":
    for s, layout in enumerate(layouts):
        got = sorted(i for (st, i), c in calls.items() if st == s and c == 1)
        assert got == list(range(len(layout))), (s, got, calls)
    assert all(c == 1 for c in calls.values()), calls
print("result", json.dumps({"rebuilt": red.rebuilt(), "buckets": red.bucket_indices(),
                            "stats": red.stats()}))
"""

CASES = {
    "default_buckets": {},
    "tiny_buckets": {"bucket_cap_mb": 0.001},
    "bucket_view": {"gradient_as_bucket_view": True},
    "bucket_view_tiny_set_to_none": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001,
                                     "set_to_none": True},
    "no_overlap": {"overlapping": False, "bucket_cap_mb": 0.001},
    "fp16_hook": {"hook": "fp16", "tol": 1e-3},
    "python_hook": {"hook": "python", "bucket_cap_mb": 0.001},
    "unused_on_some_ranks": {"unused": True, "bucket_cap_mb": 0.001},
    "gloo_path": {"shared_memory": False, "bucket_cap_mb": 0.001},
    "gloo_path_bucket_view": {"shared_memory": False, "gradient_as_bucket_view": True},
    "torch_powersgd_many_buckets": {"hook": "torch_powersgd", "bucket_cap_mb": 0.001,
                                    "steps": 8},
}


def results(res):
    return [json.loads(r.stdout.split("result", 1)[1]) for r in res]


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_torch_ddp(ranks, case):
    out = results(ranks(SCRIPT, 2, args=(json.dumps(CASES[case]),)))
    assert out[0]["buckets"] == out[1]["buckets"]
    assert out[0]["stats"]["steps"] == CASES[case].get("steps", 5)


def test_rebuild_from_a_wrong_expected_order(ranks):
    # Registration order as the expected order is the reverse of backward's.
    order = list(range(8))
    out = results(ranks(SCRIPT, 2, args=(json.dumps(
        {"bucket_cap_mb": 0.001, "expected_order": order}),)))
    for o in out:
        assert o["rebuilt"] is True
        flat = [i for b in o["buckets"] for i in b]
        assert flat.index(5) < flat.index(0), o["buckets"]  # head before fc1
    assert out[0]["buckets"] == out[1]["buckets"]


ERRORS = r"""
import torch, torch.distributed as dist, torch.nn as nn
import smp
smp.init()
rank = smp.rank()
pg = smp.get_dp_process_group()

# Shapes differ across ranks: every rank raises the same message.
p = [nn.Parameter(torch.zeros(3, 4 + rank))]
try:
    smp._C.Reducer(p, pg)
    raise SystemExit("no error")
except smp.CommError as e:
    assert str(e) == ("smp: Reducer: parameter 0 is Float[3, 4] on dp rank 0 but Float[3, 5] "
                      "on dp rank 1 (every rank must pass the same parameters in the same "
                      "order)"), str(e)

params = [nn.Parameter(torch.ones(5))]
red = smp._C.Reducer(params, pg)
try:
    red.register_builtin_hook("fp16_compress_wrapper")
    raise SystemExit("no error")
except smp.ConfigError as e:
    assert "wraps another hook: pass inner=" in str(e), str(e)
def failing_hook(state, bucket):
    raise ValueError("boom in hook")
red.register_comm_hook(None, failing_hook)
try:
    red.register_comm_hook(None, smp._C.allreduce_hook)
    raise SystemExit("no error")
except RuntimeError as e:
    assert str(e) == "smp: register_comm_hook must be called once, before the first step"
loss = (params[0] * 2).sum()
red.prepare_for_backward(True, 1.0, [loss])
loss.backward()
try:
    red.finalize()
    raise SystemExit("no error")
except smp.CommError as e:
    assert str(e).startswith(f"smp: bucket 0 of 1 (comm hook 'python hook failing_hook') on "
                             f"the dp process group (gloo, rank {rank} of 2) in step 1 failed: "
                             "ValueError: boom in hook"), str(e)

# Built-in hooks by name, wrappers with a Python inner hook, and called directly.
params = [nn.Parameter(torch.ones(7)), nn.Parameter(torch.ones(3))]
red = smp._C.Reducer(params, pg, bucket_cap_mb=0.00001)
inner_calls = []
def inner(state, bucket):
    inner_calls.append(bucket.buffer().dtype)
    return smp._C.allreduce_hook(state, bucket)  # a built-in called from Python
red.register_builtin_hook("bf16_compress_wrapper", pg, inner=inner)
for _ in range(2):
    loss = sum((p * (rank + 1.5)).sum() for p in params)
    red.prepare_for_backward(True, 1.0, [loss])
    loss.backward()
    red.finalize()
    for p in params:
        torch.testing.assert_close(p.grad, torch.full_like(p, 2.0), rtol=1e-2, atol=1e-2)
        p.grad = None
assert inner_calls == [torch.bfloat16] * 4, inner_calls
print("ok")
"""


def test_errors_and_builtin_hooks_from_python(ranks):
    for res in ranks(ERRORS, 2):
        assert res.stdout.strip().endswith("ok")


def test_builtin_hook_objects():
    import torch  # noqa: F401  (before smp._C)
    from smp import _C
    assert _C.allreduce_hook.name == "allreduce" and _C.allreduce_hook.__name__ == "allreduce_hook"
    w = _C.fp16_compress_wrapper(_C.allreduce_hook)
    assert w.name == "fp16_compress_wrapper" and w.inner == _C.allreduce_hook
    import pickle
    assert pickle.loads(pickle.dumps(w)) == w
    with pytest.raises(ValueError,
                       match=r"is not one of \{allreduce, batched_powerSGD, bf16_compress"):
        _C.BuiltinHook("powersgd")


def test_builtin_comm_hook_type():
    """smp._C.BuiltinCommHookType: the enum of the built-ins, converting to and from
    the hook names in one place (hooks/builtin.cpp)."""
    import pickle

    import torch  # noqa: F401  (before smp._C)
    from smp import _C
    T = _C.BuiltinCommHookType
    assert len(T.__members__) == len(_C.builtin_hook_names()) == 10
    assert sorted(t.hook_name for t in T.__members__.values()) == _C.builtin_hook_names()
    for t in T.__members__.values():
        assert T.from_hook_name(t.hook_name) == t
    assert T.POWER_SGD.hook_name == "powerSGD" and not T.POWER_SGD.is_wrapper
    assert T.FP16_COMPRESS_WRAPPER.is_wrapper
    # Hook objects carry their type; by type or by name they are the same hook.
    assert _C.powerSGD_hook.type == T.POWER_SGD
    assert _C.BuiltinHook(T.NOOP) == _C.BuiltinHook("noop") == _C.noop_hook
    w = _C.BuiltinHook(T.BF16_COMPRESS_WRAPPER, _C.allreduce_hook)
    assert w.type == T.BF16_COMPRESS_WRAPPER and w.name == "bf16_compress_wrapper"
    assert pickle.loads(pickle.dumps(w)) == w
    with pytest.raises(ValueError) as e:
        T.from_hook_name("POWER_SGD")
    assert str(e.value) == (
        "smp: built-in hook 'POWER_SGD' is not one of {allreduce, batched_powerSGD, "
        "bf16_compress, bf16_compress_wrapper, fp16_compress, fp16_compress_wrapper, noop, "
        "powerSGD, quantization_perchannel, quantization_pertensor}")
    with pytest.raises(ValueError, match=r"^smp: built-in hook 'fp16_compress_wrapper' wraps "
                                         r"another hook: pass inner=$"):
        _C.BuiltinHook(T.FP16_COMPRESS_WRAPPER)


PEER_EXIT = r"""
import os, time
import torch, torch.nn as nn
import smp
smp.init()
rank = smp.rank()
params = [nn.Parameter(torch.ones(1000))]
red = smp._C.Reducer(params, smp.get_dp_process_group(), timeout_s=60.0)
assert red.shared_memory()
loss = (params[0] * 2).sum()
if rank == 1:
    time.sleep(0.5)
    os._exit(3)  # dies in the middle of the step
t0 = time.monotonic()
red.prepare_for_backward(True, 1.0, [loss])
loss.backward()
try:
    red.finalize()
    raise SystemExit("no error")
except smp.CommError as e:
    assert "rank 1 (pid" in str(e) and "exited without reaching it (shared-memory reduction, " \
        "on rank 0)" in str(e) and "smp.join.Join" in str(e), str(e)
    assert time.monotonic() - t0 < 10, time.monotonic() - t0  # not the 60 s timeout
print("ok")
"""


def test_shared_memory_reports_a_peer_that_exited(ranks):
    res = ranks(PEER_EXIT, 2, check=False)
    assert res[1].returncode == 3
    assert res[0].returncode == 0 and res[0].stdout.strip() == "ok", res[0]


EXIT_HOOKS = r"""
import torch, torch.distributed as dist, torch.nn as nn
import smp
torch.set_num_threads(1)
smp.init()
pg = smp.get_dp_process_group()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
red = smp._C.Reducer(list(net.parameters()), pg, bucket_cap_mb=0.0001, timeout_s=60.0)
kept = []

def hook(state, bucket):
    fut = dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()
    child = fut.then(lambda f: f.value()[0])
    if keep:
        kept.append(child)
    return child

red.register_comm_hook(pg, hook)

def step():
    loss = net(torch.randn(4, 8)).sum()
    red.prepare_for_backward(True, 1.0, [loss])
    loss.backward()
    red.finalize()

keep = False
for _ in range(3):
    step()
# The Gloo threads drop the hook's callbacks (which hold its futures) once they ran.
released = smp._C.quiesce_python_hooks(60.0)
keep = True
step()
# Futures the script keeps stay held: the wait says so instead of hanging.
held = smp._C.quiesce_python_hooks(0.2)
print("EXIT_HOOKS", released, held, len(kept), len(red.bucket_indices()))
"""


def test_python_hook_callbacks_released_before_exit(ranks):
    # Note [Python hooks at exit] (python/csrc/bind_reducer.cpp): a Gloo thread that
    # completed a Python hook's future drops the hook's callback only afterwards, and
    # that needs the GIL; smp's atexit handler waits for it, or the thread met a
    # finalizing interpreter and the rank aborted after a successful job.
    for r in ranks(EXIT_HOOKS, 2, timeout=120):
        line = next(l for l in r.stdout.splitlines() if l.startswith("EXIT_HOOKS"))
        released, held, kept, buckets = map(int, line.split()[1:])
        assert buckets > 1 and kept == buckets, line
        assert released == 0, line
        assert held == kept, line
