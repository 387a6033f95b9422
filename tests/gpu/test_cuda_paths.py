"""smp's CUDA paths on a real GPU (tools/gpu_check.sh). Skipped where there is no GPU.

With one GPU both ranks of a 2-rank job share it: NCCL refuses two ranks on one device
(FACTS.md), so multi-rank jobs run over Gloo with CUDA tensors, and NCCL is checked with
a single-rank group. Every result is compared with the plain module or torch's own hook
in the same run.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

NET = r"""
import copy, sys, json
import torch, torch.nn as nn
import torch.distributed as dist
sys.path.insert(0, %r)
from nets import Net  # tests/python/nets.py
import smp
dev = torch.device("cuda", 0)
""" % __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "python")

PIPELINE = NET + r"""
smp.init({"partitions": 2, "microbatches": 2, "backend": "gloo"})
torch.manual_seed(0)
base = Net().to(dev)
ref = copy.deepcopy(base)
model = smp.DistributedModel(base)

@smp.step
def step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

gen = torch.Generator().manual_seed(7)
x = torch.randn(8, 8, generator=gen).to(dev)
y = torch.randn(8, 4, generator=gen).to(dev)
step(x, y)
# The plain module on the same GPU: the mean over 2 microbatches of 4 equals one batch of 8.
for xm, ym in zip(x.chunk(2), y.chunk(2)):
    (nn.functional.mse_loss(ref(xm), ym) / 2).backward()
refs = dict(ref.named_parameters())
for n, p in model.local_named_parameters():
    assert p.grad is not None and p.grad.is_cuda, n
    torch.testing.assert_close(p.grad, refs[n].grad, msg=lambda m: f"{n}: {m}")
"""

HOOKS = NET + r"""
from smp.ddp_comm_hooks import default_hooks as smp_default
from smp.ddp_comm_hooks import powerSGD_hook as smp_psgd
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as th_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as th_psgd
name = sys.argv[1]
smp.init({"ddp": True, "backend": "gloo"})
pg = smp.get_dp_process_group()
torch.manual_seed(0)
base = Net().to(dev)
ref = copy.deepcopy(base)
ddp = nn.parallel.DistributedDataParallel(ref, process_group=pg)
model = smp.DistributedModel(copy.deepcopy(base))
if name == "powerSGD":
    kw = dict(matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0)
    ddp.register_comm_hook(th_psgd.PowerSGDState(process_group=pg, **kw), th_psgd.powerSGD_hook)
    model.register_comm_hook(smp_psgd.PowerSGDState(None, **kw), smp_psgd.powerSGD_hook)
elif name != "allreduce":
    ddp.register_comm_hook(pg, getattr(th_default, name))
    model.register_comm_hook(None, getattr(smp_default, name))

@smp.step
def step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

gen = torch.Generator().manual_seed(100 + smp.rank())
for it in range(4):
    x = torch.randn(8, 8, generator=gen).to(dev)
    y = torch.randn(8, 4, generator=gen).to(dev)
    for p in ref.parameters():
        p.grad = None
    nn.functional.mse_loss(ddp(x), y).backward()
    model.zero_grad(set_to_none=True)
    step(x, y)
    for (n, p), q in zip(model.local_named_parameters(), ref.parameters()):
        assert p.grad.is_cuda, n
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name} {n}: {m}")
"""

NCCL_ONE_RANK = NET + r"""
smp.init({"backend": "nccl", "ddp": True})
t = torch.full((4,), 3.0, device=dev)
dist.all_reduce(t, group=smp.get_dp_process_group())
assert t.is_cuda and t.eq(3.0).all(), t
"""

CHECKPOINT = NET + r"""
import os
smp.init({})
torch.manual_seed(0)
model = smp.DistributedModel(Net().to(dev))
path = os.path.join(sys.argv[1], "ckpt.pt")
smp.save(model.local_state_dict(), path, partial=True)
on_cpu = smp.load(path, partial=True, map_location="cpu")
assert all(v.device.type == "cpu" for v in on_cpu.values() if torch.is_tensor(v))
back = smp.load(path, partial=True, map_location="cuda:0")
for k, v in model.local_state_dict().items():
    assert back[k].is_cuda, k
    assert torch.equal(back[k], v), k
    assert torch.equal(on_cpu[k], v.cpu()), k
"""


@pytest.mark.parametrize("hook", ["allreduce", "allreduce_hook", "fp16_compress_hook",
                                  "bf16_compress_hook", "powerSGD"])
def test_reducer_hooks_on_cuda_match_torch_ddp(ranks, hook):
    ranks(HOOKS, 2, args=(hook,))


def test_cuda_tensors_through_the_pipeline(ranks):
    ranks(PIPELINE, 2)


def test_single_rank_nccl_group(ranks):
    ranks(NCCL_ONE_RANK, 1)


def test_checkpoint_map_location(ranks, tmp_path):
    ranks(CHECKPOINT, 1, args=(str(tmp_path),))


def test_build_info_reports_cuda():
    import smp
    info = smp._C.build_info()
    assert info["cuda"] and info["nccl"], info
