"""Under ddp, a gradient produced outside model.backward() raises on every rank
(smp/grad_guard.py, Note [Unreduced gradients]) instead of leaving the replicas to
drift apart unreduced."""
import pytest

SCRIPT = r"""
import sys, torch, torch.nn as nn
import smp
mode, partitions = sys.argv[1], int(sys.argv[2])
smp.init({"ddp": True, "partitions": partitions, "timeout_s": 60})
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
x = torch.randn(4, 4) + smp.rank()

@smp.step
def good(x):
    out = model(x)
    loss = out.pow(2).sum()
    if mode == "autograd_grad":  # a gradient penalty: torch.autograd.grad is allowed
        g, = torch.autograd.grad(out.sum(), [x], create_graph=True)
        loss = loss + g.pow(2).sum()
    model.backward(loss)
    return loss

@smp.step
def bad(x):
    loss = model(x).pow(2).sum()
    loss.backward()
    return loss

if mode == "autograd_grad":
    x.requires_grad_(True)
good(x); opt.step(); opt.zero_grad()
try:
    if mode == "outside":
        model(x).pow(2).sum().backward()
    elif mode == "inside":
        bad(x)
    elif mode == "rewrap":  # the first model's hooks go with smp.shutdown()
        smp.shutdown()
        smp.init({"ddp": True, "partitions": partitions, "timeout_s": 60})
        model = smp.DistributedModel(net)
        good(x); opt.step()
    else:
        good(x); opt.step()
    print("NO ERROR")
except smp.UnreducedGradientError as e:
    print("ERR", e)
"""

OUTSIDE = ("smp: the gradient of parameter '4.bias' was computed outside @smp.step (by "
           "loss.backward() or torch.autograd.backward); with 'ddp': true it would not be "
           "reduced across the 2 model replicas, which would drift apart. To fix: run the "
           "forward and the backward inside an @smp.step function and call "
           "model.backward(loss) there (rank {r})")
INSIDE = ("smp: the gradient of parameter '{p}' was computed inside an @smp.step function "
          "by loss.backward() (or torch.autograd.backward); with 'ddp': true it would not "
          "be reduced across the 2 model replicas, which would drift apart. To fix: call "
          "model.backward(loss) there instead of loss.backward() (rank {r})")


@pytest.mark.parametrize("mode", ["outside", "inside"])
def test_loss_backward_under_ddp_raises_on_every_rank(ranks, mode):
    res = ranks(SCRIPT, 2, args=(mode, "1"))
    for r in res:
        want = (OUTSIDE if mode == "outside" else INSIDE).format(r=r.rank, p="4.bias")
        assert f"ERR {want}\n" in r.stdout, r


def test_loss_backward_in_a_pipelined_step_raises_on_every_rank(ranks):
    # pp=2 x dp=2: the driver's own parameters see the stray gradient; the driver's
    # error ends the step on its pipeline peer, which raises the driver's message.
    res = ranks(SCRIPT, 4, args=("inside", "2"))
    for r in res:
        driver = r.rank - r.rank % 2
        want = INSIDE.format(r=driver, p="0.bias").replace(
            "; with 'ddp'", "; with partitions=2 only model.backward() runs the backward "
            "across the pipeline stages and with 'ddp'")
        assert "ERR " + want in r.stdout, r


@pytest.mark.parametrize("mode", ["autograd_grad", "rewrap"])
def test_smp_backward_and_autograd_grad_are_not_stray_gradients(ranks, mode):
    res = ranks(SCRIPT, 2, args=(mode, "1"))
    for r in res:
        assert "NO ERROR" in r.stdout, r
