"""Mixed precision through the pipeline (issue 38): config fp16 with dynamic loss
scaling and bf16, fp32 master weights in smp.DistributedOptimizer, one overflow
decision per step for the whole job, clip_master_grads over every stage with a tied
embedding, GradScaler (smp's and torch's) at pp=2, checkpoint and resume under fp16,
and the errors of bad settings.

Each multi-rank run is compared with a one-process reference of the same rules written
in tests/python/mp_nets.py (an fp16 model, fp32 masters, Megatron's scaler), on the
same data, with an inf injected into one stage's gradient on one rank.
"""
import json

import pytest
import torch

import mp_nets
from conftest import run_cases

TORCH_AMP_CPU = hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler")

TRAIN = r"""
import json, os, sys
import torch
import smp
import mp_nets

opts = json.loads(sys.argv[1])
cfg = dict(opts["cfg"], microbatches=mp_nets.MB)
cfg[opts["dtype"]] = True
out = {}


def job(steps, resume=None, save=None):
    smp.init(cfg)
    torch.manual_seed(0)
    with smp.delay_param_initialization(enabled=opts.get("deferred", False)):
        net = mp_nets.TiedNet(smp.partition)
    model = smp.DistributedModel(net)
    kw = {}
    if opts["dtype"] == "fp16":
        kw = dict(dynamic_loss_scale=True, dynamic_loss_args=opts["scaler"])
    opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=opts["lr"],
                                                   momentum=0.9), **kw)
    if resume:
        smp.resume_from_checkpoint(resume)
    cur = {"step": -1, "mb": -1}

    def inject():  # after partitioning (a deferred tensor is swapped for its value then)
        for name, p in model.local_named_parameters():
            if name == mp_nets.INF_PARAM and smp.dp_rank() == 0:
                p.register_hook(lambda g: g * float("inf") if cur["step"] == opts.get("inf_step")
                                and smp.state.microbatch_of_task() == 0 else g)

    @smp.step
    def train_step(x, y):
        loss = mp_nets.loss_fn(model(x), y)
        model.backward(loss)
        return loss

    if not opts.get("deferred"):
        inject()
    rec = dict(losses=[], scales=[], overflows=[], norms=[], dtypes=set())
    first = opts.get("first_step", 0)
    for step in range(first, first + steps):
        cur["step"] = step
        x, y = mp_nets.batch(step, smp.dp_size())
        lo = smp.dp_rank() * mp_nets.PER
        loss = train_step(x[lo:lo + mp_nets.PER], y[lo:lo + mp_nets.PER]).reduce_mean().item()
        rec["losses"].append(sum(smp.allgather(loss, smp.DP_GROUP)) / smp.dp_size())
        if step == first and opts.get("deferred"):
            inject()
        if opts.get("clip"):
            rec["norms"].append(float(opt.clip_master_grads(opts["clip"])))
        opt.step()
        rec["scales"].append(opt.loss_scale)
        rec["overflows"].append(opt.overflow)
        opt.zero_grad()
    rec["dtypes"] = sorted({str(p.dtype) for p in model.local_parameters()})
    if save:
        smp.save_checkpoint(save, "ckpt")
    sd = model.state_dict()
    masters = {}
    names = {id(p): n for n, p in model.local_named_parameters()}
    for p in [p for g in opt.param_groups for p in g["params"]]:
        m = opt._smp_precision.masters.get(id(p))
        if m is not None and id(p) in names:
            masters[names[id(p)]] = m.tolist()
    rec["masters"] = smp.allgather(masters, smp.WORLD)
    rec["state"] = {k: v.float().tolist() for k, v in sd.items()}
    rec["per_rank"] = smp.allgather([rec["scales"], rec["overflows"], rec["norms"]], smp.WORLD)
    first_rank = smp.rank() == 0
    smp.shutdown()
    return rec, first_rank


if opts.get("resume"):
    d = opts["dir"]
    half = opts["steps"] // 2
    a, _ = job(half, save=d)
    opts["first_step"] = half
    b, first_rank = job(opts["steps"] - half, resume=d)
    whole = dict(b, losses=a["losses"] + b["losses"], scales=a["scales"] + b["scales"],
                 overflows=a["overflows"] + b["overflows"])
else:
    whole, first_rank = job(opts["steps"])
whole["dtypes"] = list(whole["dtypes"])
if first_rank:
    with open(opts["out"], "w") as f:
        json.dump(whole, f)
"""

SCALER = {"init_scale": 1024.0, "scale_window": 2, "min_scale": 1.0}
BASE = dict(lr=0.05, steps=6, scaler=SCALER, inf_step=3, clip=1.0)


SHARDED = {"partitions": 2, "ddp": True, "shard_optimizer_state": True}
# Every TRAIN run of this file as (world, dtype, extra). The uninterrupted runs that the
# resume test compares with are the scaling test's pp2 and pp2xdp2-sharded runs.
RUNS = [(2, "fp16", {}), (4, "fp16", {}), (4, "fp16", {"cfg": SHARDED}),
        (2, "fp16", {"deferred": True}), (2, "bf16", {"inf_step": -1}),
        (2, "fp16", {"resume": True}), (4, "fp16", {"cfg": SHARDED, "resume": True})]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`trained(world, dtype, **extra)`: (what TRAIN wrote, its options) for that run of
    RUNS. The runs of one world size go in one job (Note [One job for many cases] in
    conftest.py), made on first use; each run inits smp itself, as a job of its own."""
    made = {}

    def get(world, dtype, **extra):
        if world not in made:
            root = tmp_path_factory.mktemp(f"mp_world{world}")
            mine = [run for run in RUNS if run[0] == world]
            opts = []
            for i, (_, dt, ex) in enumerate(mine):
                d = root / f"run{i}"
                d.mkdir()
                opts.append({**BASE, "cfg": {"partitions": 2, "ddp": True}, **ex, "dtype": dt,
                             "out": str(d / "out.json"), "dir": str(d / "ckpt")})
            made[world] = (mine, opts, run_cases(TRAIN, [(json.dumps(o),) for o in opts],
                                                 world, root, timeout_per_case=300))
        mine, opts, job = made[world]
        i = mine.index((world, dtype, extra))
        job.stdout(i)
        with open(opts[i]["out"]) as f:
            return json.load(f), opts[i]
    return get


def _worst(a, b):
    worst = 0.0
    for k in b:
        worst = max(worst, (torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item())
    return worst


@pytest.mark.parametrize("world,extra", [
    (2, {}), (4, {}), (4, {"cfg": SHARDED}), (2, {"deferred": True}),
], ids=["pp2", "pp2xdp2", "pp2xdp2-sharded", "pp2-deferred"])
def test_fp16_dynamic_scaling_is_one_decision_and_equals_the_reference(trained, world, extra):
    got, opts = trained(world, "fp16", **extra)
    ref = mp_nets.reference(dict(opts, dp=world // 2))
    # The injected inf (pp rank 1, dp rank 0, step 3) makes every rank skip step 3
    # and halve its scale: one sequence on every rank, the reference's.
    assert ref["overflows"][3] and sum(ref["overflows"]) == 1, ref["overflows"]
    for scales, overflows, norms in got["per_rank"]:
        assert scales == ref["scales"]
        assert overflows == ref["overflows"]
        assert norms == pytest.approx(ref["norms"], rel=2e-3)
    assert got["dtypes"] == ["torch.float16"]
    assert got["losses"] == pytest.approx(ref["losses"], abs=2e-3)
    masters = {}
    for part in got["masters"]:
        for name, value in part.items():  # pp rank 1 holds the tied weight as the head's
            masters["emb.weight" if name == "head.weight" else name] = value
    assert set(masters) == set(ref["masters"])
    # fp16 rounding: the microbatches' and replicas' gradients add up in fp16 in
    # another order than one process's (measured: masters 1.2e-5 at pp=2, 5.9e-5 with
    # dp=2); an fp16 weight may then round to the neighbouring value (one ulp: 4.9e-4
    # near 1.0).
    assert _worst(masters, {k: ref["masters"][k] for k in masters}) < 2e-4
    assert _worst(got["state"], ref["state"]) < 1e-3


def test_bf16_config_equals_the_bf16_reference(trained):
    got, opts = trained(2, "bf16", inf_step=-1)
    ref = mp_nets.reference(dict(opts, dp=1))
    assert got["dtypes"] == ["torch.bfloat16"]
    assert all(s == [1.0] * opts["steps"] for s, _, _ in got["per_rank"])
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-3)
    assert _worst(got["state"], ref["state"]) < 1e-4  # measured 1.5e-5


@pytest.mark.parametrize("world,extra", [
    (2, {}), (4, {"cfg": SHARDED}),
], ids=["pp2", "pp2xdp2-sharded"])
def test_fp16_resume_mid_run_is_bitwise_the_uninterrupted_run(trained, world, extra):
    whole, _ = trained(world, "fp16", **extra)
    resumed, _ = trained(world, "fp16", resume=True, **extra)
    assert resumed["scales"] == whole["scales"]
    assert resumed["overflows"] == whole["overflows"]
    assert resumed["losses"] == whole["losses"]
    assert resumed["state"] == whole["state"]
    assert resumed["masters"] == whole["masters"]


SCALER_RUN = r"""
import json, sys
import torch
import smp
import mp_nets

opts = json.loads(sys.argv[1])
smp.init({"partitions": 2, "microbatches": mp_nets.MB})
torch.manual_seed(0)
net = mp_nets.TiedNet(smp.partition)
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
scaler = (smp.amp.GradScaler(init_scale=1024.0, growth_interval=2)
          if opts["which"].startswith("smp")
          else torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2))
autocast = opts["which"].endswith("autocast")
cur = {"step": -1}
for name, p in model.local_named_parameters():
    if name == mp_nets.INF_PARAM:
        p.register_hook(lambda g: g * float("inf") if cur["step"] == 3 else g)


@smp.step
def train_step(x, y):
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = mp_nets.loss_fn(model(x), y)
    model.backward(scaler.scale(loss))
    return loss


scales, stepped = [], []
for step in range(6):
    cur["step"] = step
    x, y = mp_nets.batch(step, 1)
    train_step(x, y)
    before = [p.detach().clone() for p in model.local_parameters()]
    scaler.step(opt)
    scaler.update()
    stepped.append(any(not torch.equal(a, p) for a, p in zip(before, model.local_parameters())))
    scales.append(scaler.get_scale())
    opt.zero_grad()
every = smp.allgather([scales, stepped], smp.WORLD)
sd = {k: v.tolist() for k, v in model.state_dict().items()}
if smp.rank() == 0:
    with open(opts["out"], "w") as f:
        json.dump(dict(every=every, state=sd), f)
smp.shutdown()
"""


def _scaler_reference(autocast=False):
    torch.manual_seed(0)
    net = mp_nets.TiedNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    cur = {"step": -1}
    getattr(net, "fc2").weight.register_hook(lambda g: g * float("inf") if cur["step"] == 3
                                             else g)
    scales = []
    for step in range(6):
        cur["step"] = step
        x, y = mp_nets.batch(step, 1)
        for xm, ym in zip(x.chunk(mp_nets.MB), y.chunk(mp_nets.MB)):
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = mp_nets.loss_fn(net(xm), ym)
            scaler.scale(loss / mp_nets.MB).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return scales, {k: v.tolist() for k, v in net.state_dict().items()}


@pytest.mark.skipif(not TORCH_AMP_CPU, reason="torch 1.13 has no CPU GradScaler")
@pytest.mark.parametrize("which", ["smp", "torch", "smp-autocast"])
def test_grad_scalers_agree_on_found_inf_across_stages(ranks, tmp_path, which):
    """The scaler alone, and torch's AMP recipe (fp16 autocast on CPU with the scaler),
    where a pass-through scaler let the inf step through and every weight became nan."""
    path = tmp_path / "out.json"
    ranks(SCALER_RUN, 2, args=(json.dumps(dict(which=which, out=str(path))),), timeout=200)
    got = json.loads(path.read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: fp16 kernels split their sums by thread
    try:
        ref_scales, ref_state = _scaler_reference(autocast=which.endswith("autocast"))
    finally:
        torch.set_num_threads(threads)
    (s0, stepped0), (s1, stepped1) = got["every"]
    assert s0 == s1 == ref_scales
    # Step 3 overflowed on pp rank 1 only: both ranks skipped it.
    assert stepped0[3] is False and stepped1[3] is False
    assert stepped0 == stepped1
    assert _worst(got["state"], ref_state) < 1e-6


BAD = r"""
import json, sys
import torch
import smp

case = sys.argv[1]
if case == "both":
    try:
        smp.init({"partitions": 2, "fp16": True, "bf16": True})
    except smp.ConfigError as e:
        print("ERR", e)
    sys.exit(0)
smp.init({"partitions": 2, "fp16": True})
net = torch.nn.Linear(4, 4)
model = smp.DistributedModel(net)
kw = {"scale": dict(static_loss_scale=0.0),
      "key": dict(dynamic_loss_scale=True, dynamic_loss_args={"scale_windw": 10}),
      "nomaster": dict(master_weights=False)}[case]
try:
    smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), **kw)
except smp.ConfigError as e:
    print("ERR", e)
smp.shutdown()
"""


@pytest.mark.parametrize("case,words", [
    ("both", ["'bf16'=true", "'fp16'=true"]),
    ("scale", ["static_loss_scale=0", "> 0"]),
    ("key", ["'scale_windw'", "scale_window", "allowed"]),
    ("nomaster", ["master_weights=False", "'fp16'=true"]),
])
def test_bad_settings_fail_clearly_on_every_rank(ranks, case, words):
    res = ranks(BAD, 2, args=(case,), timeout=60)
    for r in res:
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("ERR")]
        assert line, r
        for w in words:
            assert w in line[0], line[0]


def test_model_creation_builds_in_the_dtype_and_restores_the_default():
    import smp
    for dtype in (torch.float16, torch.bfloat16):
        with smp.model_creation(dtype=dtype):
            layer = torch.nn.Linear(2, 2)
            norm = torch.nn.LayerNorm(2)
        assert layer.weight.dtype == norm.bias.dtype == dtype
        assert torch.get_default_dtype() == torch.float32
    with pytest.raises(smp.ConfigError, match=r"dtype=torch.int8 .*allowed"):
        with smp.model_creation(dtype=torch.int8):
            pass
    # tensor_parallelism opens an enabled smp.tensor_parallelism context (its hints too)
    from smp.tp_substitution import tp_config
    with smp.model_creation(tensor_parallelism=True, fused_softmax=True):
        layer = torch.nn.Linear(2, 2)
    assert tp_config(layer) == (True, {"distribute_embedding": False, "fused_softmax": True})


HF_FP16 = r"""
import json, sys
import torch
import smp
import hf_nets

opts = json.loads(sys.argv[1])
smp.init({"partitions": 2, "microbatches": 2, "fp16": True})
torch.manual_seed(0)
net = hf_nets.build(opts["kind"])
model = smp.DistributedModel(net)
# Hugging Face's Trainer under SMP fp16: DistributedOptimizer, the LR scheduler on its
# `.optimizer`, clip_master_grads, and the scheduler held back on an overflowed step.
opt = smp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-3),
                               dynamic_loss_scale=True, dynamic_loss_args=opts["scaler"])
sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda s: 1.0 / (1 + s))


@smp.step
def smp_forward_backward(model, inputs):
    loss = model(**inputs)["loss"]
    model.backward(loss)
    return loss


losses, scales, norms = [], [], []
for step in range(opts["steps"]):
    b = hf_nets.batch(opts["kind"], step)
    losses.append(smp_forward_backward(model, b).reduce_mean().item())
    norms.append(float(opt.clip_master_grads(1.0)))
    opt.step()
    if not opt.overflow:
        sched.step()
    scales.append(opt.loss_scale)
    opt.zero_grad()
every = smp.allgather([scales, norms], smp.WORLD)
if smp.rank() == 0:
    with open(opts["out"], "w") as f:
        json.dump(dict(losses=losses, every=every,
                       dtypes=sorted({str(p.dtype) for p in model.local_parameters()})), f)
smp.shutdown()
"""


def _hf_fp16_reference(kind, steps, scaler_args):
    import hf_nets
    torch.manual_seed(0)
    net = hf_nets.build(kind).half()
    params = [p for p in net.parameters()]
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = mp_nets.Scaler(**scaler_args)
    losses, scales, norms = [], [], []
    for step in range(steps):
        b = hf_nets.batch(kind, step)
        parts = []
        for mb in range(2):
            sl = slice(mb * hf_nets.BATCH // 2, (mb + 1) * hf_nets.BATCH // 2)
            loss = net(**{k: v[sl] for k, v in b.items()})["loss"]
            parts.append(loss.item())
            (loss.float() / 2 * scaler.scale).backward()
        losses.append(sum(parts) / 2)
        overflow = any(not torch.isfinite(p.grad.float()).all() for p in params
                       if p.grad is not None)
        if not overflow:
            for p, m in zip(params, masters):
                m.grad = None if p.grad is None else p.grad.float() / scaler.scale
            norms.append(torch.nn.utils.clip_grad_norm_(masters, 1.0).item())
            opt.step()
            sched.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        else:
            norms.append(-1)
        scaler.update(overflow)
        scales.append(scaler.scale)
        net.zero_grad()
    return losses, scales, norms


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_hf_models_train_in_fp16_at_pp2_as_one_process(ranks, tmp_path, kind):
    pytest.importorskip("transformers")
    path = tmp_path / "out.json"
    # init_scale 2**19 overflows fp16 (max 65504) in the logits' gradient: the first
    # steps are skipped everywhere and the scale halves, as in Megatron's first steps
    # at its default 2**32.
    scaler = {"init_scale": 2.0 ** 19, "scale_window": 2}
    opts = dict(kind=kind, steps=5, scaler=scaler, out=str(path))
    ranks(HF_FP16, 2, args=(json.dumps(opts),), timeout=300)
    got = json.loads(path.read_text())
    losses, scales, norms = _hf_fp16_reference(kind, 5, scaler)
    assert got["dtypes"] == ["torch.float16"]
    for got_scales, got_norms in got["every"]:
        assert got_scales == scales
        assert got_norms == pytest.approx(norms, rel=5e-3)
    assert norms[0] == -1 and norms[-1] != -1, norms
    assert got["losses"] == pytest.approx(losses, abs=5e-3)
