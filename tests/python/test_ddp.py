"""smp.DistributedModel with partitions=1 and ddp against torch DDP, in the same run.

Every case trains the same model twice in the same 2 Gloo ranks (different data per
rank): once with torch.nn.parallel.DistributedDataParallel, once with smp, and
compares every parameter.
"""
import json
import math

import pytest

SCRIPT = r"""
import copy, json, sys
import torch, torch.distributed as dist, torch.nn as nn
import smp

opts = json.loads(sys.argv[1])
smp.init({"ddp": True, "microbatches": opts.get("microbatches", 1)})
rank, world = smp.rank(), smp.size()
torch.manual_seed(0)

class Net(nn.Module):
    def __init__(self, unused=False):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.spare = nn.Linear(32, 4) if unused else None
    def forward(self, x, use_spare=False):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.spare(h) if use_spare else self.head(h)

base = Net(opts.get("unused", False))
ref = copy.deepcopy(base)
ddp = nn.parallel.DistributedDataParallel(
    ref, process_group=smp.get_dp_process_group(),
    bucket_cap_mb=opts.get("bucket_cap_mb", 25),
    gradient_as_bucket_view=opts.get("gradient_as_bucket_view", False),
    find_unused_parameters=opts.get("unused", False))
if opts.get("hook") == "fp16":
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as th
    ddp.register_comm_hook(smp.get_dp_process_group(), th.fp16_compress_hook)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

model_src = copy.deepcopy(base)
opt = torch.optim.SGD(model_src.parameters(), lr=0.1)  # built before wrapping (SMP v1)
model = smp.DistributedModel(
    model_src, bucket_cap_mb=opts.get("bucket_cap_mb", 25),
    gradient_as_bucket_view=opts.get("gradient_as_bucket_view", False),
    backward_passes_per_step=opts.get("bpps", 1),
    overlapping_allreduce=opts.get("overlapping", True))
opt = smp.DistributedOptimizer(opt)
calls = []
if opts.get("hook") == "fp16":
    model.register_comm_hook(smp.get_dp_process_group(),
                             smp.ddp_comm_hooks.default_hooks.fp16_compress_hook)
elif opts.get("hook") == "python":
    def counting_hook(state, bucket):
        calls.append((bucket.index(), bucket.is_last(), bucket.buffer().numel(),
                      [tuple(g.shape) for g in bucket.gradients()],
                      [tuple(p.shape) for p in bucket.parameters()]))
        fut = dist.all_reduce(bucket.buffer().div_(world), group=state, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    model.register_comm_hook(smp.get_dp_process_group(), counting_hook)

@smp.step
def train_step(x, y, use_spare=False):
    out = model(x, use_spare)
    loss = nn.functional.mse_loss(out, y)
    model.backward(loss)
    return loss

bpps = opts.get("bpps", 1)
gen = torch.Generator().manual_seed(100 + rank)
for step in range(opts.get("steps", 5)):
    use_spare = opts.get("unused", False) and step % 2 == 1
    for micro in range(bpps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        # torch DDP: one whole-batch step (no_sync for all but the last pass).
        if micro < bpps - 1:
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(x, use_spare), y).backward()
        else:
            nn.functional.mse_loss(ddp(x, use_spare), y).backward()
        out = train_step(x, y, use_spare)
        assert isinstance(out, smp.StepOutput) and len(out.outputs) == smp.num_microbatches()
    ref_opt.step(); ref_opt.zero_grad()
    opt.step(); opt.zero_grad()

tol = opts.get("tol", 1e-5)
for (name, p), q in zip(model.named_parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
assert list(model.state_dict()) == list(base.state_dict()), list(model.state_dict())
assert all(p is q for p, q in zip(model.parameters(), model_src.parameters()))
print("buckets", json.dumps(model._reducer.bucket_indices() if model._reducer else []))
print("calls", json.dumps(calls))
"""

CASES = {
    "default_buckets": {},
    "tiny_buckets": {"bucket_cap_mb": 0.001},
    "bucket_view": {"gradient_as_bucket_view": True},
    "bucket_view_tiny": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001},
    "no_overlap": {"overlapping": False, "bucket_cap_mb": 0.001},
    "fp16_hook": {"hook": "fp16", "tol": 1e-3},
    "backward_passes_per_step_2": {"bpps": 2},
    "microbatches_4": {"microbatches": 4},
    "unused_parameters": {"unused": True, "steps": 4},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_torch_ddp(ranks, case):
    ranks(SCRIPT, 2, args=(json.dumps(CASES[case]),))


def test_python_hook_called_once_per_bucket(ranks):
    res = ranks(SCRIPT, 2, args=(json.dumps({"hook": "python", "bucket_cap_mb": 0.001,
                                             "steps": 3}),))
    calls = json.loads(res[0].stdout.split("calls", 1)[1])
    buckets = json.loads(res[0].stdout.split("buckets", 1)[1].splitlines()[0])
    n = len(buckets)
    assert n >= 2, buckets  # tiny buckets: several
    param_shapes = sorted([[4], [4, 32], [32], [32, 32], [32], [32, 8]])
    assert len(calls) == 3 * n, calls  # once per bucket per step
    for step in range(3):
        per_step = calls[step * n:(step + 1) * n]
        assert [c[0] for c in per_step] == list(range(n))  # launched in bucket order
        assert [c[1] for c in per_step] == [False] * (n - 1) + [True]
        seen = []
        for index, is_last, numel, grads, params in per_step:
            assert grads == params and len(grads) == len(buckets[index])
            assert numel == sum(math.prod(s) for s in grads)
            seen += grads
        assert sorted(seen) == param_shapes  # every parameter in exactly one bucket
