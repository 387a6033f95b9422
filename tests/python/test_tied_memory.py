"""The memory of a weight tied across pp ranks (smp_core/tied_grads.cpp): the ranks that
hold a tied embedding peak above what they hold by exactly the copies torch's backward
makes, no more (Note [One gradient copy per weight]).

A tied 8000 x 512 embedding (16 MB) on pp ranks 0 and 3 of 4, built deferred; per
phase, each rank's peak resident set minus its parameters and gradients, the holders'
against the others'. The copies start equal (a broadcast in place), are checked each
step (a fingerprint) and their gradients are summed (an allreduce in place): none of
it makes a tensor the embedding's size. With gradients of None between steps torch
makes a copy per microbatch after the first; with zeros, one per microbatch, and smp
leaves the zeros in place (Note [Zero gradients stay]); with -0.0, set aside as an
accumulated gradient is, the holders do peak one embedding higher, so the measure
sees a copy.
"""
import json

import pytest
import torch

TORCH_2 = int(torch.__version__.split(".")[0]) >= 2

SCRIPT = r"""
import json, sys
import torch, torch.nn as nn
import smp

VOCAB, D, TOKENS = 8000, 512, 16


from nets import reset_peak, status_mb  # tests/python/nets.py


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.GELU())
                                      for _ in range(4)])
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        return self.head(self.blocks(self.tok(idx)))


torch.set_num_threads(1)
MB = int(sys.argv[1])
smp.init({"partitions": 4, "microbatches": MB})
with torch.device("meta"):  # torch's meta kernels (~150 MB of code), before measuring
    nn.Linear(4, 4)(torch.ones(1, 4))
torch.manual_seed(0)
with smp.delay_param_initialization():
    net = Net()
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
data = torch.randint(0, VOCAB, (MB, TOKENS + 1), generator=torch.Generator().manual_seed(1))


@smp.step
def train(x, y):
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    model.backward(loss)
    return loss


def held_mb(grads):
    return sum(p.numel() * (2 if grads else 1) for p in model.local_parameters()) * 4 / 2**20


def step():
    loss = train(data[:, :-1], data[:, 1:]).reduce_mean()
    opt.step()
    return loss.item()


over, losses = {}, []
reset_peak()
start = status_mb("VmRSS")
losses.append(step())  # partition, materialize, copy the tied weight, train
over["first"] = status_mb("VmHWM") - start - held_mb(grads=True)


def negative_zeros():  # not all zero bits: set aside (Note [Zero gradients stay])
    for p in model.local_parameters():
        if p.grad is not None:
            p.grad.fill_(-0.0)


for phase, clear in (("none", lambda: opt.zero_grad(set_to_none=True)),
                     ("zeros", lambda: opt.zero_grad(set_to_none=False)),
                     ("negative_zeros", negative_zeros)):
    for _ in range(2):
        clear()
        reset_peak()
        start = status_mb("VmRSS")
        losses.append(step())
        # The start held the gradients already, except with None: then the step made them.
        made = held_mb(grads=True) - held_mb(grads=False) if phase == "none" else 0.0
        over[phase] = max(over.get(phase, 0.0), status_mb("VmHWM") - start - made)
tied = any(p.numel() == VOCAB * D for p in model.local_parameters())
print("RESULT " + json.dumps(dict(rank=smp.pp_rank(), tied=tied, over=over, losses=losses,
                                  held=held_mb(grads=False))))
smp.shutdown()
"""

_EMBEDDING_MB = 8000 * 512 * 4 / 2**20  # 15.6

# The copies of the embedding beside a holder's parameter and gradient, per phase:
# torch's (Note [One gradient copy per weight]), a microbatch's gradient made whole and
# then added to a .grad that exists (each one after the first when .grad is None, each
# one when it holds zeros), one at a time; and with -0.0 the gradient set aside beside
# the step's (Note [Zero gradients stay]).
_COPIES = {1: {"none": 0, "zeros": 1, "negative_zeros": 1},
           2: {"none": 1, "zeros": 1, "negative_zeros": 2}}


@pytest.mark.skipif(not TORCH_2, reason="deferred init needs torch >= 2.0")
@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_ranks_holding_a_tied_embedding_make_no_copy_of_it(ranks, microbatches):
    # Every tensor of 64 KiB or more mapped on its own and unmapped when freed (Note
    # [Fixed mmap threshold] in smp_core/runtime.h): the resident set follows the
    # tensors, not the allocator's caches.
    res = ranks(SCRIPT, 4, env={"SMP_MMAP_THRESHOLD": 65536}, args=(str(microbatches),),
                timeout=150)
    rows = [json.loads(r.stdout.split("RESULT ", 1)[1].splitlines()[0]) for r in res]
    assert [r["tied"] for r in rows] == [True, False, False, True], rows
    assert all(r["losses"] == rows[0]["losses"] for r in rows), rows
    holders = [r for r in rows if r["tied"]]
    others = [r for r in rows if not r["tied"]]

    def excess(phase):  # the holders' peak over what they hold, beyond the others', MB
        return max(h["over"][phase] for h in holders) - max(o["over"][phase] for o in others)

    for phase, copies in _COPIES[microbatches].items():
        want = copies * _EMBEDDING_MB
        assert abs(excess(phase) - want) < _EMBEDDING_MB / 2, (phase, excess(phase), want, rows)
    # The first step (partition, materialize, copy the tied weight, its first sum) adds
    # none either (the others materialize the embedding in the trace too).
    first = (_COPIES[microbatches]["none"] + 0.5) * _EMBEDDING_MB
    assert excess("first") < first, (excess("first"), rows)


ZEROS = r"""
import copy, json, sys
import torch, torch.nn as nn
import smp

opts = json.loads(sys.argv[1])
smp.init({"partitions": 2, "microbatches": 2, "ddp": True})
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 64), nn.ReLU(),
                    nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 8))
net[6].weight = net[0].weight  # tied: the first and the last stage hold it
ref = copy.deepcopy(net)  # the plain module, one process, the whole batch
model = smp.DistributedModel(net, gradient_as_bucket_view=opts["bucket_view"])
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)


@smp.step
def train(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss


@smp.step
def evaluate(x):
    return model(x)


per = 16 // smp.dp_size()
lo = smp.dp_rank() * per
for step in range(4):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g)
    train(x[lo:lo + per], y[lo:lo + per])
    opt.step()
    opt.zero_grad(set_to_none=False)  # zeros: left in place by the next step's sum
    with torch.no_grad():  # no backward: the tied gradient is restored, zeros again
        evaluate(x[lo:lo + per])
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=False)
tied = [p for p in model.local_parameters() if p is net[0].weight]
zero_bits = all(not p.grad.view(torch.int32).any() for p in tied)
full = model.state_dict()  # collective: every rank
if smp.rank() == 0:
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
print("RESULT " + json.dumps(dict(rank=smp.rank(), tied=len(tied), zero_bits=zero_bits)))
smp.shutdown()
"""


@pytest.mark.parametrize("bucket_view", [False, True], ids=["grads", "bucket-views"])
def test_zero_gradients_left_in_place_train_as_the_plain_module(ranks, bucket_view):
    # Note [Zero gradients stay] at pp=2 x dp=2: the tied weight's zeros stay .grad (with
    # gradient_as_bucket_view, a view into the reducer's bucket), the backward and the
    # sum over the holders add to them, the dp reduction reads them; a step without
    # backward leaves them zeros. SGD with momentum against one process.
    res = ranks(ZEROS, 4, args=(json.dumps(dict(bucket_view=bucket_view)),), timeout=150)
    rows = [json.loads(r.stdout.split("RESULT ", 1)[1].splitlines()[0]) for r in res]
    assert sum(r["tied"] for r in rows) == 4, rows  # every rank: first and last stage
    assert all(r["zero_bits"] for r in rows), rows
