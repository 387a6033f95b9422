"""The same pipelined job gives the same numbers, whatever the timing, the schedule or the
partitioning (Note [Microbatch random streams] in smp_core/task_rng.h, Note [Gradient
order] in smp_core/dispatch.h, Note [Layout travels] in smp_core/p2p.cpp).

examples/gpt_checkpoint.py's GPT-style model with Dropout 0.2 (random masks drawn on
the ranks that own the blocks, attention outputs crossing ranks as transposed views)
trains three AdamW steps;
every run reports its losses, a SHA-256 of every parameter and the driver's next
torch.rand() after training. Runs are compared by those, for equality.
"""
import json
import pathlib

EXAMPLES = str(pathlib.Path(__file__).resolve().parents[2] / "examples")

TRAIN = r"""
import json, sys
import torch, torch.nn as nn
import smp

opts = json.loads(sys.argv[1])
sys.path.insert(0, opts["examples"])
from gpt_checkpoint import CTX, GPT, VOCAB  # tied head, Dropout, MultiheadAttention

from nets import gpt_job, train_gpt  # tests/python/nets.py
model, opt = gpt_job(smp, GPT, opts["cfg"])

losses, params = train_gpt(smp, model, opt, VOCAB, CTX)
stats = model._engine.dispatch.stats()
assert stats.unplanned_steps == 0, stats.unplanned_steps  # steps 2 and 3 went as step 1
after = torch.rand(3).tolist()  # the user's own stream, outside the steps
if smp.rank() == 0:
    print("RESULT " + json.dumps({"losses": losses, "params": params, "after": after}))
smp.shutdown()
"""


def _result(ranks, world, cfg):
    res = ranks(TRAIN, world, args=(json.dumps({"cfg": cfg, "examples": EXAMPLES}),),
                timeout=240)
    line = next(l for l in res[0].stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_identical_pp2_dp2_runs_are_equal_bitwise(ranks):
    # Before the random streams and the gradient order, two such runs differed after
    # the first step (masks drawn in request arrival order; gradients summed in it).
    cfg = {"partitions": 2, "ddp": True}
    first, second = _result(ranks, 4, cfg), _result(ranks, 4, cfg)
    assert first == second


def test_schedule_and_partitioning_do_not_change_the_numbers(ranks):
    # The same data on one replica: pp=2 under every schedule and pp=4 draw the same
    # masks and sum gradients in the same order, so they agree to the last bit.
    interleaved = _result(ranks, 2, {"partitions": 2})
    simple = _result(ranks, 2, {"partitions": 2, "pipeline": "simple"})
    one_f_one_b = _result(ranks, 2, {"partitions": 2, "pipeline": "1f1b"})
    pp4 = _result(ranks, 4, {"partitions": 4})
    # Executing the plan as written (Note [Executed plan]) changes the order, not the sums.
    planned = _result(ranks, 2, {"partitions": 2, "pipeline": "1f1b", "pipeline_order": "planned"})
    # zero_bubble splits pp rank 1's backwards into I and W (Note [Split backward]): the
    # same kernels, each gradient summed in microbatch order.
    zero_bubble = _result(ranks, 2, {"partitions": 2, "pipeline": "zero_bubble"})
    assert simple == interleaved
    assert one_f_one_b == interleaved
    assert pp4 == interleaved
    assert planned == interleaved
    assert zero_bubble == interleaved


LAYOUT = r"""
import torch, torch.nn as nn
import smp

class Producer(nn.Module):
    def forward(self, x):
        t = x.t()
        return t, t  # one transposed view, returned twice

class Consumer(nn.Module):
    def forward(self, a, b, c):
        assert a is b, "a tensor passed twice must arrive as one object"
        a.mul_(2)  # in place on one argument: the other (the same tensor) sees it
        return a + b + c, torch.tensor(a.stride())

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        with smp.partition(0):
            self.produce = Producer()
        with smp.partition(1):
            self.consume = Consumer()
    def forward(self, x):
        t, t2 = self.produce(x)
        assert t is t2
        return self.consume(t, t2, t.clone())

smp.init({"partitions": 2, "microbatches": 1, "auto_partition": False,
          "default_partition": 0})
model = smp.DistributedModel(Net())

@smp.step
def run(x):
    return model(x)

x = torch.arange(12.0).reshape(3, 4)
out, strides = (o.outputs[0] for o in run(x))
# One process: a = b = t (the same object), doubled in place, plus c = the original t.
torch.testing.assert_close(out, 5 * torch.arange(12.0).reshape(3, 4).t(), rtol=0, atol=0)
assert tuple(strides.tolist()) == x.t().stride(), strides  # (1, 4): the transposed layout
smp.shutdown()
"""


def test_aliasing_and_layout_cross_ranks_as_in_one_process(ranks):
    ranks(LAYOUT, 2, timeout=120)


BATCHNORM = r"""
import json, sys
import torch, torch.nn as nn
import smp

cfg = json.loads(sys.argv[1])
smp.init(dict(cfg, microbatches=4, auto_partition=False, default_partition=0))
torch.manual_seed(0)


class Alternating(nn.Module):
    # Small layers whose owners alternate between pp ranks (placed by smp.partition),
    # each a call of its own, with BatchNorm on both ranks: their running statistics
    # change in every forward, so they hold the order in which the microbatches reached
    # them (Note [Forward order] in smp_core/detail/plan_execution.cpp).

    def __init__(self, pp):
        super().__init__()
        self.lins, self.bns = nn.ModuleList(), nn.ModuleList()
        for i in range(6):
            with smp.partition(i % pp):
                self.lins.append(nn.Linear(16, 16))
            with smp.partition((i + 1) % pp):
                self.bns.append(nn.BatchNorm1d(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        for lin, bn in zip(self.lins, self.bns):
            x = torch.relu(bn(lin(x)))
        return self.head(x)


net = Alternating(cfg.get("partitions", 1))
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))

@smp.step
def train(x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    model.backward(loss)
    return loss

for step in range(3):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)
    train(x, y)
    opt.step()
    opt.zero_grad()
from nets import state_digest  # tests/python/nets.py
state = state_digest(model.state_dict())
if smp.rank() == 0:
    print("RESULT " + json.dumps({"state": state}))
smp.shutdown()
"""


def test_batchnorm_statistics_take_the_microbatches_in_order(ranks):
    # Each microbatch reaches every BatchNorm in microbatch order at pp=2, in the dynamic
    # order (the default) and under a plan, as in one process; before Note [Forward
    # order] an answer arriving early let a later microbatch overtake.
    def state(world, cfg):
        res = ranks(BATCHNORM, world, args=(json.dumps(cfg),), timeout=120)
        line = next(l for l in res[0].stdout.splitlines() if l.startswith("RESULT "))
        return json.loads(line[len("RESULT "):])["state"]
    one = state(1, {})
    for _ in range(3):
        assert state(2, {"partitions": 2}) == one
    assert state(2, {"partitions": 2, "pipeline": "1f1b", "pipeline_order": "planned"}) == one
