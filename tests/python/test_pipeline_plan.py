"""With config 'pipeline_order' "planned" the runtime executes the step's plan as written
(Note [Executed plan] in smp_core/detail/plan_execution.cpp): from the second training
step on, every
pp rank's compute token
goes to its planned actions in the plan's order; a step whose calls differ from the
recorded ones leaves the plan, is counted, and still trains as one process does.

Each job trains three steps with smp and, in the same process, a plain copy of the
model on the whole batch; parameters are compared at the end.
"""
import json
import re

import pytest

COMMON = r"""
import copy, json, sys
import torch, torch.nn as nn
import smp

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))

class Chain(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 3)
    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)

class Loop(nn.Module):
    # How often pp rank 1's block runs depends on the microbatch's data.
    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.Linear(8, d)
        with smp.partition(1):
            self.mid = Block(d)
        self.head = nn.Linear(d, 3)
    def forward(self, x):
        h = self.inp(x)
        for _ in range(2 if x[0, 0] > 0 else 1):
            h = self.mid(h)
        return self.head(h)

def train(net, batches):
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05))
    @smp.step
    def step(x, y):
        loss = nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss
    per, dp = batches[0][0].shape[0] // smp.dp_size(), smp.dp_size()
    lo, hi = smp.dp_rank() * per, (smp.dp_rank() + 1) * per
    for x, y in batches:
        step(x[lo:hi], y[lo:hi])
        opt.step(); opt.zero_grad()
        # One process, the same microbatches summed: the reference.
        mbs = smp.num_microbatches()
        loss = sum(nn.functional.mse_loss(ref(xm), ym)
                   for r in range(dp)
                   for xm, ym in zip(x[r * per:(r + 1) * per].chunk(mbs),
                                     y[r * per:(r + 1) * per].chunk(mbs))) / (mbs * dp)
        loss.backward()
        ref_opt.step(); ref_opt.zero_grad()
    full = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
    return model
"""

EXECUTE = COMMON + r"""
smp.init(dict(json.loads(sys.argv[1]), timeout_s=30, pipeline_order="planned"))
torch.manual_seed(0)
g = torch.Generator().manual_seed(3)
batches = [(torch.randn(8 * smp.dp_size(), 8, generator=g), torch.randn(8 * smp.dp_size(), 3, generator=g))
           for _ in range(3)]
model = train(Chain(), batches)
d = model._engine.dispatch
st = d.stats()
print("PLAN " + json.dumps({"rank": smp.rank(), "planned": d.planned_actions(),
                            "executed": d.executed_actions(), "planned_steps": st.planned_steps,
                            "fallbacks": st.plan_fallbacks, "split": st.split_backwards,
                            "weights": st.weight_actions, "backwards": st.native_backwards}))
"""


def _reports(results):
    return [json.loads(r.stdout.split("PLAN ", 1)[1].splitlines()[0]) for r in results]


@pytest.mark.parametrize("world,cfg", [
    (2, {"partitions": 2, "microbatches": 4, "pipeline": "interleaved"}),
    (2, {"partitions": 2, "microbatches": 4, "pipeline": "simple"}),
    (2, {"partitions": 2, "microbatches": 4, "pipeline": "1f1b"}),
    (4, {"partitions": 4, "microbatches": 8, "pipeline": "1f1b"}),
    (4, {"partitions": 2, "microbatches": 4, "pipeline": "interleaved", "ddp": True}),
    (2, {"partitions": 2, "microbatches": 8, "pipeline": "zero_bubble"}),
    (4, {"partitions": 4, "microbatches": 8, "pipeline": "zero_bubble"}),
    (4, {"partitions": 2, "microbatches": 4, "pipeline": "zero_bubble", "ddp": True}),
], ids=["pp2-interleaved", "pp2-simple", "pp2-1f1b", "pp4-1f1b", "pp2xdp2-interleaved",
        "pp2-zero_bubble", "pp4-zero_bubble", "pp2xdp2-zero_bubble"])
def test_runtime_executes_the_plan_as_written(ranks, world, cfg):
    results = ranks(EXECUTE, world, args=(json.dumps(cfg),), timeout=240)
    # The driver says which plan its steps execute, once.
    said = re.findall(r"smp: executing the pipeline plan (\S+), (\d+) microbatches",
                      results[0].stderr)
    assert said == [(cfg["pipeline"], str(cfg["microbatches"]))], results[0].stderr
    reports = _reports(results)
    for rep in reports:
        # Steps 2 and 3 ran the plan of step 1's calls, action for action, on every rank.
        assert rep["planned_steps"] == 2 and rep["fallbacks"] == 0, rep
        assert rep["planned"] and rep["executed"] == rep["planned"], rep
        weights = [a for a in rep["planned"] if a.startswith("W")]
        if cfg["pipeline"] != "zero_bubble" or rep["rank"] % cfg["partitions"] == 0:
            # The driver runs its backward whole (PlanOptions::unsplit_rank).
            assert not weights and rep["split"] == rep["weights"] == 0, rep
        else:
            # Note [Zero bubble at run time]: each planned step split every served
            # backward of this rank and ran its W at the W's turn.
            assert len(weights) == sum(a.startswith("I") for a in rep["planned"]) > 0, rep
            assert rep["split"] == rep["weights"] == 2 * len(weights), rep


FALLBACK = COMMON + r"""
smp.init({"partitions": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0,
          "timeout_s": 20, "pipeline_order": "planned", "pipeline": sys.argv[1]})
torch.manual_seed(0)
g = torch.Generator().manual_seed(5)
batches = []
for signs in [(1, 1), (1, -1), (1, 1)]:  # step 2's second microbatch calls pp rank 1 once
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)
    for mb, s in enumerate(signs):
        x[4 * mb, 0] = s * (1 + x[4 * mb, 0].abs())
    batches.append((x, y))
model = train(Loop(), batches)
st = model._engine.dispatch.stats()
print("PLAN " + json.dumps({"rank": smp.rank(), "planned_steps": st.planned_steps,
                            "fallbacks": st.plan_fallbacks, "planned": [], "executed": [],
                            "departure": model._engine.dispatch.plan_departure()}))
"""


@pytest.mark.parametrize("pipeline", ["interleaved", "zero_bubble"])
def test_data_dependent_step_leaves_the_plan_and_matches_one_process(ranks, pipeline):
    # zero_bubble: the W pending when the step leaves its plan run at once, in
    # microbatch order (Note [Zero bubble at run time]); the numbers still match.
    results = ranks(FALLBACK, 2, args=(pipeline,), timeout=180)
    for rep in _reports(results):
        # Step 2 began with step 1's plan and left it; step 3 had no uniform path to
        # plan (step 2's microbatches differed), so it ran without a list.
        assert rep["planned_steps"] == 1 and rep["fallbacks"] == 1, rep
    # Note [Leaving the plan]: never silent. The driver saw microbatch 1 call pp rank 1
    # once where the plan has two calls there, and says so in a warning.
    driver = _reports(results)[0]
    assert driver["departure"].startswith("microbatch 1"), driver
    assert "the plan has" in driver["departure"], driver
    warned = [l for l in results[0].stderr.splitlines() if "left its pipeline plan" in l]
    assert len(warned) == 1 and driver["departure"] in warned[0], results[0].stderr[-2000:]


EVAL_INSIDE = COMMON + r"""
smp.init({"partitions": 2, "microbatches": 2, "timeout_s": 20, "pipeline_order": "planned"})
torch.manual_seed(0)
g = torch.Generator().manual_seed(9)
model = smp.DistributedModel(Chain())
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

@smp.step
def eval_step(x):
    with torch.no_grad():  # evaluation decided inside the step body
        return model(x)

x, y = torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)
outs = []
for i in range(3):  # train, eval, train, eval, train
    if i:
        outs.append(eval_step(x).concat())
    train_step(x, y); opt.step(); opt.zero_grad()
d = model._engine.dispatch
st = d.stats()
print("PLAN " + json.dumps({"rank": smp.rank(), "planned_steps": st.planned_steps,
                            "fallbacks": st.plan_fallbacks, "unplanned": st.unplanned_steps,
                            "departure": d.plan_departure(), "planned": d.planned_actions(),
                            "executed": d.executed_actions(),
                            "eval_finite": bool(torch.isfinite(outs[-1]).all())
                                           if smp.pp_rank() == 0 else True}))
"""


def test_evaluation_inside_a_step_body_keeps_the_training_plan(ranks):
    # Note [Evaluation inside a step]: an eval step that begins with grad mode on (no_grad
    # inside its body) leaves the training plan without a warning, and the training steps
    # after it still execute their plan (steps 2 and 3).
    results = ranks(EVAL_INSIDE, 2, timeout=120)
    driver, server = _reports(results)
    # Training steps 2 and 3 and the two eval steps began with the plan; the eval steps
    # left it, unreported on the driver (pp rank 1 counts the kPlanOff it hears before
    # the step ends, a matter of timing); the last training step executed its plan.
    assert driver["planned_steps"] == server["planned_steps"] == 4, (driver, server)
    assert driver["fallbacks"] == 0 and server["fallbacks"] <= 2, (driver, server)
    for rep in (driver, server):
        assert rep["departure"] == "" and rep["eval_finite"] and rep["unplanned"] == 0, rep
        assert rep["planned"] and rep["executed"] == rep["planned"], rep
    for r in results:
        assert "left its pipeline plan" not in r.stderr, r.stderr[-2000:]


HEAD_SOMETIMES = COMMON + r"""
class HeadSometimes(Loop):
    # Loop's modules; the driver's last hop (after pp rank 1's block) runs the head only
    # for inputs whose column 1 is large: then it accumulates gradients on the driver.
    def forward(self, x):
        h = self.mid(self.inp(x))
        return self.head(h) if x[0, 1] > 50 else h[:, :3]

smp.init({"partitions": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0,
          "timeout_s": 20, "pipeline_order": "planned", "pipeline": sys.argv[1]})
torch.manual_seed(0)
g = torch.Generator().manual_seed(7)
batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)) for _ in range(4)]
batches[1][0][:, 1] = 100.0  # step 2: every microbatch's last hop runs the head
model = train(HeadSometimes(), batches)
d = model._engine.dispatch
st = d.stats()
print("PLAN " + json.dumps({"rank": smp.rank(), "planned_steps": st.planned_steps,
                            "fallbacks": st.plan_fallbacks, "planned": d.planned_actions(),
                            "executed": d.executed_actions()}))
"""


@pytest.mark.parametrize("pipeline", ["1f1b", "interleaved", "zero_bubble"])
def test_last_hop_that_starts_accumulating_leaves_the_plan(ranks, pipeline):
    # Note [Last hop's gradients] (smp_core/detail/gradient_order.cpp): step 1's last
    # hop on the driver accumulated nothing, so step 2's plan lets microbatch k + 1's loss come
    # before microbatch k's backward through pp rank 0. Step 2's last hop accumulates
    # (the head): its first wait for an earlier microbatch leaves the plan instead of
    # waiting for an action planned after it. From then on the driver plans the last
    # hop as accumulating: steps 3 and 4 execute that plan as written, and every step
    # trains as one process does (train() compares the parameters).
    reports = _reports(ranks(HEAD_SOMETIMES, 2, args=(pipeline,), timeout=180))
    for rep in reports:
        assert rep["planned_steps"] == 3 and rep["fallbacks"] == 1, rep
        assert rep["executed"] == rep["planned"], rep
    driver = reports[0]["planned"]
    for k in range(3):  # the loss of k + 1 after k's backward through pp rank 0
        assert driver.index(f"B{k}.h0") < driver.index(f"F{k + 1}.h2"), driver


# Three steps of `model`; a ValueError is printed with its step and exits 3.
RUN_THREE_STEPS = r"""
@smp.step
def step(x):
    out = model(x)
    model.backward(out.sum())
    return out
for i in range(3):
    try:
        step(torch.randn(4, 8))
    except ValueError as e:
        print("raised in step", i + 1, e)
        sys.exit(3)
"""

FAILS = COMMON + r"""
class Late(nn.Linear):
    calls = 0
    def forward(self, x):
        if not smp.is_tracing():
            Late.calls += 1
            if Late.calls == 6:  # step 3, microbatch 1 (two calls a step)
                raise ValueError("kaboom in step 3")
        return super().forward(x)

class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        with smp.partition(1):
            self.b = Late(8, 8)
        self.c = nn.Linear(8, 3)
    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x))))

smp.init({"partitions": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0,
          "timeout_s": 60, "pipeline_order": "planned"})
model = smp.DistributedModel(Two())
"""
FAILS += RUN_THREE_STEPS


DYNAMIC = EXECUTE.replace(', pipeline_order="planned"', ', pipeline_order="dynamic"')


def test_dynamic_order_executes_no_plan(ranks):
    # "dynamic": no plan is run; each step is ordered by the plans' rule as its work
    # becomes ready (Note [Order without a list] in smp_core/plan.cpp), and what each
    # rank ran is recorded in the plan's vocabulary, without hops: every microbatch's
    # forward and backward actions, the same number of each per microbatch.
    cfg = {"partitions": 2, "microbatches": 4}
    for rep in _reports(ranks(DYNAMIC, 2, args=(json.dumps(cfg),), timeout=120)):
        assert rep["planned_steps"] == 0 and rep["planned"] == [], rep
        ran = rep["executed"]
        assert ran and all(re.fullmatch(r"[FB][0-3]", a) for a in ran), rep
        per_mb = {mb: sorted(a[0] for a in ran if a[1:] == str(mb)) for mb in range(4)}
        assert all(v == per_mb[0] and "F" in v and "B" in v for v in per_mb.values()), rep


def test_failure_in_a_planned_step_marks_the_failing_action(ranks):
    for r in ranks(FAILS, 2, check=False, timeout=120):
        assert r.returncode == 3 and "raised in step 3 kaboom in step 3" in r.stdout, r
        # Every rank logs the plan the step executed, the failing action marked.
        assert "executed plan interleaved, 2 microbatches, 2 pp ranks" in r.stderr, r
        assert re.search(r"pp 1 \|.* \[F1(\.h1)?\]", r.stderr), r
        assert re.search(r"failed: pp rank 1, F1\.h1", r.stderr), r


WFAILS = COMMON + r"""
class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        with smp.partition(1):
            self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)
    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x))))

smp.init({"partitions": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0,
          "timeout_s": 60, "pipeline": "zero_bubble"})
model = smp.DistributedModel(Two())
calls = []
def hook(grad):  # runs where pp rank 1's weight gradient accumulates: in its W
    calls.append(1)
    if len(calls) == 5:  # step 3, microbatch 0
        raise ValueError("kaboom in a W of step 3")
    return grad
if smp.pp_rank() == 1:
    model.module.b.weight.register_hook(hook)
"""
WFAILS += RUN_THREE_STEPS


def test_failure_in_a_weight_action_fails_the_step_on_every_rank(ranks):
    # A W runs after its call's answer went out; the driver ends the step only once
    # every W is over, so the W's error still fails that step, on every rank.
    for r in ranks(WFAILS, 2, check=False, timeout=120):
        assert r.returncode == 3 and "raised in step 3 kaboom in a W of step 3" in r.stdout, r
        assert "executed plan zero_bubble, 2 microbatches, 2 pp ranks" in r.stderr, r
        # The failure table marks the W that failed, not its I.
        assert re.search(r"pp 1 \|.* I0\.h1 .*\[W0\.h1\]", r.stderr), r
        assert "failed: pp rank 1, W0.h1" in r.stderr, r
        assert "microbatch 0, backward (its weight-gradient half, W)" in r.stderr, r
