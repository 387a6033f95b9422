"""smp on CUDA tensors, against the plain module or torch's own hook in the same run.
One GPU serves every rank (ranks share cuda:0; Gloo carries CUDA tensors), except the
NCCL test, which is one rank (one GPU cannot hold two NCCL ranks)."""
import pytest

HOOKS = ["allreduce", "fp16", "bf16", "powersgd", "batched_powersgd",
         "quantize_per_tensor", "quantize_per_channel"]

REDUCER = r"""
import json, sys
import torch, torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as tdef
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tpsgd
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as tquant
import smp
from smp.ddp_comm_hooks import default_hooks as sdef, powerSGD_hook as spsgd
from smp.ddp_comm_hooks import quantization_hooks as squant
from nets import Net

hook = sys.argv[1]
smp.init({"ddp": True, "backend": "gloo"})
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
torch.manual_seed(0)
base = Net().to(dev)
ref = Net().to(dev); ref.load_state_dict(base.state_dict())
model = smp.DistributedModel(base, bucket_cap_mb=0.001)
ddp = DistributedDataParallel(ref, process_group=smp.get_dp_process_group(),
                              bucket_cap_mb=0.001)
def pair():
    if hook == "allreduce":
        return (None, tdef.allreduce_hook), (None, sdef.allreduce_hook)
    if hook == "fp16":
        return (None, tdef.fp16_compress_hook), (None, sdef.fp16_compress_hook)
    if hook == "bf16":
        return (None, tdef.bf16_compress_hook), (None, sdef.bf16_compress_hook)
    if hook in ("powersgd", "batched_powersgd"):
        kw = dict(process_group=None, start_powerSGD_iter=2, matrix_approximation_rank=2,
                  random_seed=7)
        name = "powerSGD_hook" if hook == "powersgd" else "batched_powerSGD_hook"
        return ((tpsgd.PowerSGDState(**kw), getattr(tpsgd, name)),
                (spsgd.PowerSGDState(**kw), getattr(spsgd, name)))
    name = {"quantize_per_tensor": "quantization_pertensor_hook",
            "quantize_per_channel": "quantization_perchannel_hook"}[hook]
    return (None, getattr(tquant, name)), (None, getattr(squant, name))
(tstate, thook), (sstate, shook) = pair()
ddp.register_comm_hook(tstate, thook)
model.register_comm_hook(sstate, shook)
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

gen = torch.Generator().manual_seed(100 + smp.rank())
for step in range(5):
    x, y = torch.randn(16, 8, generator=gen).to(dev), torch.randn(16, 4, generator=gen).to(dev)
    nn.functional.mse_loss(ddp(x), y).backward()
    train_step(x, y)
    ref_opt.step(); ref_opt.zero_grad()
    opt.step(); opt.zero_grad()
torch.cuda.synchronize()
tol = {"fp16": 1e-3, "bf16": 1e-2}.get(hook, 1e-5)
for (name, p), q in zip(model.named_parameters(), ref.parameters()):
    assert p.is_cuda
    torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m: f"{hook} {name}: {m}")
print("ok", hook)
"""


@pytest.mark.parametrize("hook", HOOKS)
def test_reducer_and_hooks_on_cuda_match_torch_ddp(ranks, hook):
    """Every hook on CUDA gradients, dp=2, against torch DDP with torch's own hook (the
    stream ordering of Note [Streams across threads] is what a wrong result would show)."""
    ranks(REDUCER, 2, args=(hook,), timeout=240)


PIPELINE = r"""
import copy, json, sys
import torch, torch.nn as nn
import smp
from nets import Net

smp.init({"partitions": 2, "microbatches": 4, "ddp": True, "p2p_transport": sys.argv[1]})
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
torch.manual_seed(0)
net = Net()
plain = copy.deepcopy(net).to(dev)
model = smp.DistributedModel(net.to(dev))
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05)

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

gen = torch.Generator().manual_seed(5)
for step in range(3):
    x, y = torch.randn(16, 8, generator=gen).to(dev), torch.randn(16, 4, generator=gen).to(dev)
    out = train_step(x, y)
    ref = nn.functional.mse_loss(plain(x), y)
    ref.backward(); plain_opt.step(); plain_opt.zero_grad()
    opt.step(); opt.zero_grad()
    torch.testing.assert_close(out.reduce_mean().to(dev), ref.detach(), rtol=1e-5, atol=1e-5)
print("ok pipeline")
"""


@pytest.mark.parametrize("transport", ["tcp", "c10d"])
def test_cuda_tensors_through_the_pipeline(ranks, transport):
    """pp=2 with CUDA activations and gradients crossing between the stages, by the TCP
    mesh and by c10d send/recv (Gloo here: NCCL cannot hold two ranks on one GPU)."""
    ranks(PIPELINE, 2, args=(transport,), timeout=240)


CHECKPOINT = r"""
import sys
import torch, torch.nn as nn
import smp
from nets import Net

path = sys.argv[1]
smp.init({"ddp": True})
torch.manual_seed(0)
model = smp.DistributedModel(Net().to("cuda"))
smp.save(model.state_dict(), path, partial=False)
smp.barrier()
on_cpu = smp.load(path, map_location="cpu", partial=False)
on_gpu = smp.load(path, map_location="cuda:0", partial=False)
for name, t in model.state_dict().items():
    assert on_cpu[name].device.type == "cpu" and on_gpu[name].is_cuda, name
    assert torch.equal(on_cpu[name], t.cpu()) and torch.equal(on_gpu[name], t), name
print("ok checkpoint")
"""


def test_save_and_load_with_map_location(ranks, tmp_path):
    ranks(CHECKPOINT, 2, args=(str(tmp_path / "ck.pt"),), timeout=180)


NCCL = r"""
import torch, torch.nn as nn
import torch.distributed as dist
import smp
from nets import Net

smp.init({"ddp": True, "backend": "nccl"})
assert dist.get_backend(smp.get_dp_process_group()) in ("nccl", "cpu:gloo,cuda:nccl")
torch.manual_seed(0)
net = Net().cuda()
plain = Net().cuda(); plain.load_state_dict(net.state_dict())
model = smp.DistributedModel(net)

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 4, device="cuda")
train_step(x, y)
nn.functional.mse_loss(plain(x), y).backward()
for p, q in zip(model.parameters(), plain.parameters()):
    torch.testing.assert_close(p.grad, q.grad)
assert smp.allgather(smp.rank()) == [0]
print("ok nccl")
"""


def test_single_rank_nccl_group(ranks):
    ranks(NCCL, 1, timeout=180)
