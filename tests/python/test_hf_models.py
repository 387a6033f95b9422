"""Hugging Face `transformers` models under smp, as a new user trains them (issue 37):
GPT-2, BERT and T5 from tiny configs, with an attention mask, at pp=2 and pp=2 x dp=2,
built under `smp.delay_param_initialization`, with `smp.set_activation_checkpointing`
on every block (the default config: GPT-2 caches keys and values), and with both plus
`shard_optimizer_state`. Each run trains with SGD (no momentum: float noise is not
amplified) and must land where the plain model lands in one process on the same
global batch.

Also here: torch.compile on the wrapper and before wrapping (state dicts and names),
the names `named_parameters()` gives, and the errors that name their cause.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")  # a test-only dependency (README)

import hf_nets  # noqa: E402  (beside this file)
from conftest import run_cases  # noqa: E402

TORCH_2 = int(torch.__version__.split(".")[0]) >= 2
STEPS = 3

TRAIN = r"""
import json, sys, warnings
import torch
import smp
import hf_nets

opts = json.loads(sys.argv[1])
kind = opts["kind"]
out = {}
for mode in opts["modes"]:
    cfg = dict(opts["cfg"], microbatches=2)
    if "shard" in mode:
        cfg["shard_optimizer_state"] = True
    smp.init(cfg)
    torch.manual_seed(0)
    with smp.delay_param_initialization(enabled="deferred" in mode):
        net = hf_nets.build(kind)
    model = smp.DistributedModel(net)
    if "ckpt" in mode:
        for block in hf_nets.blocks(kind, model.get_module()):
            smp.set_activation_checkpointing(block)
    opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5))

    @smp.step
    def step(b):
        loss = model(**b).loss
        model.backward(loss)
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = hf_nets.train(lambda b: step(b).reduce_mean().item(), opt, kind,
                               opts["steps"], smp.dp_size(), smp.dp_rank() * hf_nets.BATCH)
    losses = smp.allgather(losses, smp.DP_GROUP)
    sd = {k: v.tolist() for k, v in model.state_dict().items()}
    out[mode] = dict(losses=[sum(l) / len(l) for l in zip(*losses)], state=sd,
                     smp_warnings=[str(w.message) for w in caught
                                   if str(w.message).startswith("smp")])
    first = smp.rank() == 0
    smp.shutdown()
if first:
    with open(opts["out"], "w") as f:
        json.dump(out, f)
"""


def _reference(kind, dp):
    losses, state = hf_nets.plain_run(kind, STEPS, dp)
    return losses, state


def _close(state, ref):
    assert list(state) == list(ref), "state dict keys differ from the plain model's"
    worst = max((torch.tensor(state[k]) - ref[k].float()).abs().max().item() for k in ref)
    return worst


MODES = ["deferred", "ckpt", "deferred+ckpt+shard"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`trained(kind, world, cfg, modes)`: what TRAIN wrote for `kind`. The kinds of one
    layout train in one job (Note [One job for many cases] in conftest.py), each kind a
    case with its own smp.init per mode, as a job of its own would."""
    made = {}

    def get(kind, world, cfg, modes):
        key = json.dumps([world, cfg, modes])
        if key not in made:
            d = tmp_path_factory.mktemp(f"hf_world{world}")
            cases = [(json.dumps(dict(kind=k, cfg=cfg, modes=modes, steps=STEPS,
                                      out=str(d / f"{k}.json"))),) for k in hf_nets.KINDS]
            made[key] = (d, run_cases(TRAIN, cases, world, d, timeout_per_case=400))
        d, job = made[key]
        job.stdout(hf_nets.KINDS.index(kind))
        return json.loads((d / f"{kind}.json").read_text())
    return get


@pytest.mark.skipif(not TORCH_2, reason="deferred init needs torch >= 2.0")
@pytest.mark.parametrize("kind", hf_nets.KINDS)
@pytest.mark.parametrize("world,cfg,modes", [
    (2, {"partitions": 2}, MODES),
    (4, {"partitions": 2, "ddp": True}, MODES),
], ids=["pp2", "pp2xdp2"])
def test_hf_models_train_as_the_plain_model(trained, kind, world, cfg, modes):
    got = trained(kind, world, cfg, modes)
    dp = world // 2
    ref_losses, ref_state = _reference(kind, dp)
    for mode in modes:
        run = got[mode]
        # (dp > 1: the mean of the replicas' mean losses is the global batch's mean)
        assert run["losses"] == pytest.approx(ref_losses, abs=2e-5), mode
        assert _close(run["state"], ref_state) < 1e-5, mode
        assert run["smp_warnings"] == [], mode


COMPILED = r"""
import json, sys, warnings
import torch, torch.nn as nn
import smp
from nets import Net

opts = json.loads(sys.argv[1])
smp.init({"partitions": 2, "microbatches": 2})
torch.manual_seed(0)
net = Net()
plain_names = [n for n, _ in net.named_parameters()]
if opts["where"] == "before":
    net = torch.compile(net)
model = smp.DistributedModel(net)
run = torch.compile(model) if opts["where"] == "after" else model
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@smp.step
def step(x, y):
    loss = nn.functional.mse_loss(run(x), y)
    model.backward(loss)
    return loss


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        opt.zero_grad()
        step(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
        opt.step()
import torch._dynamo.utils as dynamo_utils
breaks = sum(n for why, n in dynamo_utils.counters["graph_break"].items()
             if "torch.compiler.disable" not in why)
sd, run_sd = model.state_dict(), run.state_dict()
names = [n for n, _ in model.named_parameters()]
local = [n for n, _ in model.local_named_parameters()]
# Loads both ways: keys of a compiled plain module, and smp's keys into the compiled run.
ones = {"_orig_mod." + k: torch.ones_like(v) for k, v in sd.items()}
loaded1 = str(model.load_state_dict(ones))
all_ones = all(bool((v == 1).all()) for v in model.state_dict().values())
loaded2 = str(run.load_state_dict(sd))
back = all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
if smp.rank() == 0:
    print("RESULT " + json.dumps(dict(
        keys=list(sd), run_keys=list(run_sd), same=all(torch.equal(sd[k], run_sd[k]) for k in sd),
        plain=plain_names, names=names, local=local, loaded=[loaded1, loaded2],
        all_ones=all_ones, back=back, breaks=breaks,
        warnings=[str(w.message)[:200] for w in caught])))
smp.shutdown()
"""


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile needs torch >= 2.0")
@pytest.mark.parametrize("where", ["after", "before", "none"])
def test_compiled_state_dicts_and_names_are_the_plain_modules(ranks, where):
    res = ranks(COMPILED, 2, args=(json.dumps({"where": where}),), timeout=240)
    line = next(l for l in res[0].stdout.splitlines() if l.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    assert got["keys"] == got["run_keys"] == got["plain"] == got["names"]
    assert got["same"]
    assert set(got["local"]) < set(got["names"]) and got["local"]
    assert got["loaded"] == ["<All keys matched successfully>"] * 2
    assert got["all_ones"] and got["back"]
    # smp's own path neither warns nor breaks Dynamo's graphs (its remote calls are
    # skipped on purpose: Note [Calls are not compiled]); the trace runs eagerly.
    assert got["warnings"] == [] and got["breaks"] == 0


ERRORS = r"""
import json, sys
import torch, torch.nn as nn
import smp
from nets import Net

case = sys.argv[1]
smp.init({"partitions": 2, "microbatches": 2})
torch.manual_seed(0)
model = smp.DistributedModel(Net())


@smp.step
def step(x, y, late):
    loss = nn.functional.mse_loss(model(x), y)
    if case in ("backward", "late backward") and (late or case == "backward"):
        loss.backward()
    else:
        model.backward(loss)
    return loss


for i in range(2):
    try:
        step(torch.randn(8, 8), torch.randn(8, 4), i > 0)
    except Exception as e:
        print(f"ERROR {type(e).__name__}: {e}")
        break
smp.shutdown()
"""


@pytest.mark.parametrize("case,kind,text", [
    ("backward", "UnreducedGradientError", "with partitions=2 only model.backward() runs "
     "the backward across the pipeline stages. To fix: call model.backward(loss)"),
    ("late backward", "UnreducedGradientError", "with partitions=2 only model.backward()"),
])
def test_mistakes_at_pp2_name_their_cause_on_every_rank(ranks, case, kind, text):
    res = ranks(ERRORS, 2, args=(case,), timeout=120)
    for r in res:
        line = next((l for l in r.stdout.splitlines() if l.startswith("ERROR ")), None)
        assert line is not None, r
        assert line.startswith(f"ERROR {kind}: ") and text in line, line
    if case == "backward":  # raised while tracing: where in the user's code
        assert "loss.backward()" in line and "script_" in line, line


TIED = r"""
import sys
import torch, torch.nn as nn
import smp
sys.path.insert(0, sys.argv[2])
from gpt_checkpoint import CTX, GPT, VOCAB
from nets import gpt_job

case = sys.argv[1]
model, opt = gpt_job(smp, GPT, {"partitions": 2}, dropout=0.0)
net = model.get_module()
assert net.head.weight is net.tok.weight


@smp.step
def train_step(x, y):
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    model.backward(loss)
    return loss


for i in range(3):
    data = torch.randint(0, VOCAB, (8, CTX + 1), generator=torch.Generator().manual_seed(i))
    try:
        train_step(data[:, :-1], data[:, 1:])
    except smp.TiedCopiesError as e:
        print(f"ERROR {e}")
        break
    # One holder's step is skipped (as a per-rank loss scaler that found an inf does),
    # or one copy is changed outside the optimizer.
    if not (case == "skipped" and i == 1 and smp.pp_rank() == 1):
        opt.step()
    if case == "changed" and i == 1 and smp.pp_rank() == 1:
        with torch.no_grad():
            net.head.weight.mul_(1.001)
    opt.zero_grad()
smp.shutdown()
"""


@pytest.mark.parametrize("case,text", [
    ("skipped", "pp rank 0 applied 2 optimizer steps to it and pp rank 1 1: an optimizer "
     "step was skipped or taken on some pipeline ranks only"),
    ("changed", "differ: every holder applied the same 2 optimizer steps to it, so the "
     "gradient or the value of one copy was changed outside the optimizer's step"),
])
def test_tied_copies_error_says_what_differs(ranks, case, text):
    import pathlib
    examples = str(pathlib.Path(__file__).resolve().parents[2] / "examples")
    res = ranks(TIED, 2, args=(case, examples), timeout=180)
    for r in res:
        line = next((l for l in r.stdout.splitlines() if l.startswith("ERROR ")), None)
        assert line is not None, r
        assert text in line, line
