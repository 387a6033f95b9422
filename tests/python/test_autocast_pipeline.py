"""torch.autocast through the pipeline (Note [Autocast travels] in
smp_core/autocast_state.h): at pp=2 every module runs in the dtype it runs in when the
plain model runs in one process under the same autocast, on whichever rank owns it,
with autocast inside the step body or around the step call, through nested calls,
and in the recomputation of a checkpointed block; the first step's trace sees it too.

Each run is compared with the plain model in one process, fed the same microbatches
(the whole batch at once rounds otherwise in the last bits), under the same autocast,
with the same backward scaling (1 / microbatches), on one thread as the ranks: every
module's output dtypes (forward hooks) and the losses of 3 SGD steps. Modes: autocast
inside the step body, around the step call, inside with every block checkpointed
(pp rank 1's recompute on it), around under zero_bubble (pp rank 1's weight halves
run later, each under its request's state).
"""
import contextlib
import json
import re

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")  # a test-only dependency (README)

import hf_nets  # noqa: E402  (beside this file)
from nets import Nested  # noqa: E402

STEPS, MICROBATCHES = 3, 2
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)

TRAIN = r"""
import contextlib, json, sys
import torch
import smp
import hf_nets

opts = json.loads(sys.argv[1])
kind = opts["kind"]
out = {}
for mode in opts["modes"]:
    zero_bubble = {"pipeline": "zero_bubble"} if "zero_bubble" in mode else {}
    smp.init(dict({"partitions": 2, "microbatches": 2}, **zero_bubble))
    torch.manual_seed(0)
    net = hf_nets.build(kind)
    dtypes = hf_nets.record_dtypes(net, lambda: "trace" if smp.is_tracing() else "step")
    model = smp.DistributedModel(net)
    if "ckpt" in mode:
        for block in hf_nets.blocks(kind, model.get_module()):
            smp.set_activation_checkpointing(block)
    opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5))
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)

    @smp.step
    def step(b):
        with bf16() if "inside" in mode else contextlib.nullcontext():
            loss = model(**b).loss
        model.backward(loss)
        return loss

    def run(b):
        with bf16() if "around" in mode else contextlib.nullcontext():
            return step(b).reduce_mean().item()

    losses = hf_nets.train(run, opt, kind, opts["steps"])
    everyone = smp.allgather(dtypes, smp.PP_GROUP)
    owner = {n: p["partition"] for n, p in model.partition_plan().items()}
    # (zero_bubble: the serving rank's weight halves ran as actions of their own)
    weights = smp.allgather(model.pipeline.engine.dispatch.stats().weight_actions, smp.PP_GROUP)
    out[mode] = dict(losses=losses, dtypes=everyone, owner=owner, weight_actions=weights)
    first = smp.rank() == 0
    smp.shutdown()
if first:
    with open(opts["out"], "w") as f:
        json.dump(out, f)
"""


def plain_run(kind, mode):
    """The plain model in one process, microbatch by microbatch as the step runs them:
    (losses, {module name: output dtypes})."""
    torch.manual_seed(0)
    model = hf_nets.build(kind)
    dtypes = hf_nets.record_dtypes(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def autocast_if(where):
        return torch.autocast(**BF16) if where in mode else contextlib.nullcontext()

    def step_fn(b):
        losses = []
        with autocast_if("around"):
            for mb in range(MICROBATCHES):
                part = {k: v.chunk(MICROBATCHES)[mb] for k, v in b.items()}
                with autocast_if("inside"):
                    loss = model(**part).loss
                torch.autograd.backward(loss, torch.ones_like(loss) / MICROBATCHES)
                losses.append(loss.detach())
        return torch.mean(torch.stack(losses)).item()
    with one_thread():
        return hf_nets.train(step_fn, opt, kind, STEPS), dtypes["run"]


@contextlib.contextmanager
def one_thread():
    """As the ranks compute (OMP_NUM_THREADS=1, conftest.rank_env): a bfloat16 kernel's
    reduction may split by thread, and round otherwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def assert_same_losses(got, ref, what):
    """The same ops on the same values: the first step's loss bit for bit; the later
    steps' within 1e-6 (a tied parameter's gradient sums over its holders in another
    order, ~4e-9 apart in float32). Seen: every loss bit for bit, GPT-2 and BERT alike."""
    assert got[0] == ref[0], what
    assert got == pytest.approx(ref, rel=1e-6, abs=0), what


def merged(tables, phase):
    """{module name: output dtypes} of `phase` over the pp ranks' tables."""
    out = {}
    for table in tables:
        for name, sigs in table.get(phase, {}).items():
            out.setdefault(name, [])
            out[name] += [s for s in sigs if s not in out[name]]
    return out


def dtype_differences(got, ref):
    return {n: (got.get(n), ref.get(n)) for n in sorted(set(got) | set(ref))
            if sorted(got.get(n) or []) != sorted(ref.get(n) or [])}


MODES = ["inside", "around", "inside+ckpt", "around+zero_bubble"]


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_autocast_reaches_every_stage_as_in_one_process(ranks, tmp_path, kind):
    path = tmp_path / "out.json"
    opts = dict(kind=kind, modes=MODES, steps=STEPS, out=str(path))
    ranks(TRAIN, 2, args=(json.dumps(opts),), timeout=300)
    got = json.loads(path.read_text())
    fp32_losses, _ = plain_run(kind, "")
    for mode in MODES:
        run = got[mode]
        ref_losses, ref_dtypes = plain_run(kind, mode)
        assert any(p == 1 for p in run["owner"].values()), mode
        if "ckpt" in mode:  # a checkpointed block recomputes on pp rank 1
            blocks = [n for n in run["owner"] if re.fullmatch(r".*\.(h|layer)\.[0-9]+", n)]
            assert any(run["owner"][b] == 1 for b in blocks), (mode, blocks)
        if "zero_bubble" in mode:  # each W under its backward request's autocast
            assert run["weight_actions"][1] > 0, run["weight_actions"]
        assert "bfloat16" in json.dumps(ref_dtypes)  # autocast did something
        # The trace (every rank runs the whole model) and the step (each module on its
        # owner; a checkpointed block's recomputation adds its calls) alike.
        for r, table in enumerate(run["dtypes"]):
            assert dtype_differences(table["trace"], ref_dtypes) == {}, (mode, "trace", r)
        assert dtype_differences(merged(run["dtypes"], "step"), ref_dtypes) == {}, mode
        assert_same_losses(run["losses"], ref_losses, mode)
        assert run["losses"][0] != fp32_losses[0], mode


NESTED = r"""
import json, sys
import torch, torch.nn as nn
import smp
import hf_nets

from nets import Nested

smp.init({"partitions": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
torch.manual_seed(0)
net = Nested(smp.partition)
dtypes = hf_nets.record_dtypes(net, lambda: "trace" if smp.is_tracing() else "step")
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))


@smp.step
def step(x, y):
    loss = nn.functional.mse_loss(model(x).float(), y)
    model.backward(loss)
    return loss


losses, tables = [], []
for i, autocast in enumerate([True, False, True]):
    x, y = Nested.batch(i)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses.append(step(x, y).reduce_mean().item())
    opt.step()
    tables.append(smp.allgather({"step": dtypes.pop("step", {})}, smp.PP_GROUP))
if smp.rank() == 0:
    print("RESULT " + json.dumps(dict(losses=losses, tables=tables)))
smp.shutdown()
"""


def test_a_nested_call_runs_under_its_callers_autocast(ranks, tmp_path):
    res = ranks(NESTED, 2, timeout=120)
    line = next(l for l in res[0].stdout.splitlines() if l.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    torch.manual_seed(0)
    net = Nested()
    dtypes = hf_nets.record_dtypes(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for i, autocast in enumerate([True, False, True]):  # the second step without
        with one_thread():
            _plain_nested_step(net, opt, i, autocast, losses)
        ref = dtypes.pop("run")
        assert dtype_differences(merged(got["tables"][i], "step"), ref) == {}, i
        inner = "bfloat16" if autocast else "float32"
        assert ref["outer.inner"] == [inner] and ref["outer.kept_fp32"] == ["float32"], ref
        # Each module ran on its owner only: inner and kept_fp32 on pp rank 0.
        assert set(got["tables"][i][1]["step"]) == {"outer", "outer.lin"}, got["tables"][i]
    assert_same_losses(got["losses"], losses, "nested")


def _plain_nested_step(net, opt, i, autocast, losses):
    x, y = Nested.batch(i)
    opt.zero_grad()
    with torch.autocast(**BF16, enabled=autocast):
        step = []
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            loss = nn.functional.mse_loss(net(xm).float(), ym)
            torch.autograd.backward(loss, torch.ones_like(loss) / MICROBATCHES)
            step.append(loss.detach())
    opt.step()
    losses.append(torch.mean(torch.stack(step)).item())
