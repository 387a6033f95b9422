"""Deferred initialization (smp/deferred_init.py, Note [Replayed init]) and loading a
full checkpoint one partition at a time (Note [Mapped loads] in
smp/checkpoint/_torch_load.py).

A model built inside `smp.delay_param_initialization` has meta tensors until the first
step partitions it; each rank then replays the init of what it keeps. Its values must
equal the eager build's from the same seed, before and after training, at any
partitioning; and a meta-built model must load a full checkpoint without any rank
reading or holding another partition's tensors.
"""
import hashlib
import json
import pathlib

import pytest
import torch

TORCH_2 = int(torch.__version__.split(".")[0]) >= 2
# Deferred models need torch >= 2.0 (storage identity, operator tags, swap_tensors); on
# torch 1.13 the context raises naming the version (the last test).
needs_torch_2 = pytest.mark.skipif(not TORCH_2, reason="deferred init needs torch >= 2.0")

EXAMPLES = str(pathlib.Path(__file__).resolve().parents[2] / "examples")

GPT_RUN = r"""
import json, sys
import torch
import smp

opts = json.loads(sys.argv[1])
sys.path.insert(0, opts["examples"])
from gpt_checkpoint import CTX, GPT, VOCAB
from nets import gpt_job, state_digest, train_gpt  # tests/python/nets.py

model, opt = gpt_job(smp, GPT, opts["cfg"], deferred=opts["deferred"])
meta = all(p.is_meta for p in model.get_module().parameters())
hooked = []  # what a post-partition hook sees: real tensors, its own partition's
model.register_post_partition_hook(lambda m, o: hooked.append(
    any(p.is_meta for p in m.get_module().parameters()) or
    not all(p.numel() for p in m.local_parameters())))
after_build = torch.rand(4).tolist()  # the generator is where an eager build leaves it

@smp.step
def logits(x):
    return model(x)

logits(torch.randint(0, VOCAB, (8, CTX)))  # partitions: 0 training steps
step0 = state_digest(model.state_dict())
tied = model.get_module().head.weight is model.get_module().tok.weight
losses, params = train_gpt(smp, model, opt, VOCAB, CTX)
if smp.rank() == 0:
    print("RESULT " + json.dumps(dict(meta=meta, after_build=after_build, tied=tied, hooked=hooked,
                                      step0=step0, losses=losses, params=params)))
smp.shutdown()
"""


def _gpt(ranks, world, cfg, deferred):
    opts = dict(cfg=cfg, deferred=deferred, examples=EXAMPLES)
    res = ranks(GPT_RUN, world, args=(json.dumps(opts),), timeout=240)
    line = next(l for l in res[0].stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@needs_torch_2
@pytest.mark.parametrize("world,cfg", [
    (1, {}),
    (2, {"partitions": 2}),
    (4, {"partitions": 2, "ddp": True}),
], ids=["pp1", "pp2", "pp2xdp2"])
def test_a_deferred_gpt_equals_the_eager_one(ranks, world, cfg):
    eager = _gpt(ranks, world, cfg, deferred=False)
    deferred = _gpt(ranks, world, cfg, deferred=True)
    assert deferred["meta"] and not eager["meta"]
    assert deferred["tied"] and eager["tied"]
    assert deferred["hooked"] == eager["hooked"] == [False]
    assert deferred["after_build"] == eager["after_build"]
    assert deferred["step0"] == eager["step0"]  # after partitioning, before training
    assert deferred["losses"] == eager["losses"]
    assert deferred["params"] == eager["params"]  # after 3 AdamW steps


INITS = r"""
import hashlib, json, math, sys, warnings
import torch, torch.nn as nn
import smp


class Positional(nn.Module):  # a buffer computed from factories and math
    def __init__(self, d=16, n=12):
        super().__init__()
        pe = torch.zeros(n, d)
        pos = torch.arange(0, n, dtype=torch.float).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return x + self.pe[: x.shape[1]]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 16, padding_idx=0)   # a view filled in place
        self.pos = Positional()
        self.attn = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
        self.norm = nn.BatchNorm1d(12)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40)
        nn.init.orthogonal_(self.proj.weight)            # skipped by nn.init on meta
        nn.init.trunc_normal_(self.head.weight, std=0.02)  # redraws: reads its values
        self.head.weight.data.mul_(0.5)                  # an op after the init function
        self.apply(self._hf_style)

    @staticmethod
    def _hf_style(m):  # Hugging Face's _init_weights
        if isinstance(m, nn.Linear) and m.bias is not None:
            m.bias.data.normal_(mean=0.0, std=0.02)

    def forward(self, x):
        return self.head(self.proj(self.norm(self.attn(self.pos(self.emb(x))))))


opts = json.loads(sys.argv[1])
smp.init(dict(opts["cfg"], microbatches=2))
torch.manual_seed(0)
with smp.delay_param_initialization(enabled=opts["deferred"]):
    net = Net()
after_build = torch.rand(3).tolist()
model = smp.DistributedModel(net)

@smp.step
def run(x):
    return model(x)

# Eval mode: the step must not change BatchNorm's statistics, which hold the init here
# (at pp > 1 the first step's order of microbatches on a serving rank is not fixed).
model.eval()
run(torch.randint(0, 40, (4, 12)))
mine = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
        for k, v in model.local_state_dict().items() if torch.is_tensor(v)}
held = {n: p.numel() > 0 for n, p in net.named_parameters()}
out = dict(rank=smp.rank(), mine=mine, held=held, after_build=after_build,
           devices=sorted({str(p.device) for p in net.parameters()}))
print("RESULT " + json.dumps(out))
smp.shutdown()
"""


def _results(res):
    out = []
    for r in res:
        line = next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))
        out.append(json.loads(line[len("RESULT "):]))
    return out


@needs_torch_2
def test_init_functions_and_buffers_replay_exactly_and_each_rank_holds_its_own(ranks):
    cfg = {"partitions": 2}
    eager = _results(ranks(INITS, 2, args=(json.dumps(dict(cfg=cfg, deferred=False)),)))
    lazy = _results(ranks(INITS, 2, args=(json.dumps(dict(cfg=cfg, deferred=True)),)))
    for e, d in zip(eager, lazy):
        assert d["mine"] == e["mine"], d["rank"]
        assert d["after_build"] == e["after_build"]
        assert d["held"] == e["held"]  # the same partition, and only its own tensors
        assert d["devices"] == ["cpu"]
    assert not all(lazy[0]["held"].values()) and not all(lazy[1]["held"].values())


MEMORY = r"""
import hashlib, json, resource, sys, warnings
import torch, torch.nn as nn
import smp

opts = json.loads(sys.argv[1])
WIDTH = 2048


from nets import reset_peak, status_mb  # tests/python/nets.py


smp.init({"partitions": 4, "microbatches": 1})
# torch's meta kernels are Python (they import sympy and more, ~150 MB of code, once
# per process); load them in every run, so the measures below see tensors only.
with torch.device("meta"):
    nn.Linear(4, 4)(torch.ones(1, 4))
reset_peak()
start = status_mb("VmRSS")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if opts["build"] == "meta":
        with torch.device("meta"):
            net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    else:
        net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    model = smp.DistributedModel(net)

    @smp.step
    def run(x):
        return model(x)

    with torch.no_grad():
        run(torch.ones(2, WIDTH))  # partitions; each rank allocates what it keeps
    first = status_mb("VmHWM") - start
    reset_peak()
    base = status_mb("VmRSS")
    if opts["load"] == "torch.load":   # Hugging Face's way: a mapped torch.load
        model.load_state_dict(torch.load(opts["path"], mmap=True))
    elif opts["load"] == "smp.load":
        model.load_state_dict(smp.load(opts["path"], partial=False))
    else:                              # the whole file, read
        model.load_state_dict(torch.load(opts["path"]))
    with torch.no_grad():
        run(torch.ones(2, WIDTH))
    load = status_mb("VmHWM") - base
mine = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
        for k, v in model.local_state_dict().items() if torch.is_tensor(v)}
warned = [str(w.message) for w in caught if "meta" in str(w.message)]
print("RESULT " + json.dumps(dict(first=first, load=load, mine=mine, warned=warned)))
smp.shutdown()
"""

_LAYER_MB = 2048 * 2048 * 4 / 2**20  # 16 MiB of weight per layer


def _save_model(path, smp_format):
    import torch
    import torch.nn as nn
    torch.manual_seed(3)
    net = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
    sd = net.state_dict()
    if smp_format:
        import smp
        smp.save(sd, str(path), partial=False)
    else:
        torch.save(sd, str(path))
    return {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
            for k, v in sd.items()}


def _memory(ranks, build, load, path):
    opts = dict(build=build, load=load, path=str(path))
    return _results(ranks(MEMORY, 4, args=(json.dumps(opts),), timeout=180))


@needs_torch_2
@pytest.mark.parametrize("load", ["torch.load", "smp.load"])
def test_a_meta_built_model_loads_a_full_checkpoint_one_partition_per_rank(ranks, tmp_path,
                                                                          load):
    path = tmp_path / "model.pt"
    want = _save_model(path, smp_format=(load == "smp.load"))
    seen = {}
    for r in _memory(ranks, "meta", load, path):
        seen.update(r["mine"])
        assert len(r["mine"]) == 2, r["mine"]  # one Linear's weight and bias
        # Loading read its own layer from the mapped file and nothing of the other
        # three: well under two layers' worth of resident memory (peak, this rank).
        assert r["load"] < 2 * _LAYER_MB, r
        assert r["warned"], "a meta-built model warns that reset_parameters() made its values"
    assert seen == want


@needs_torch_2
def test_the_same_measures_see_an_eager_build_and_a_whole_file_read(ranks, tmp_path):
    # The bounds above can fail: each measure sees a rank holding the other layers.
    path = tmp_path / "model.pt"
    _save_model(path, smp_format=False)
    read = _memory(ranks, "meta", "read", path)   # meta-built, but reads the whole file
    eager = _memory(ranks, "eager", "torch.load", path)  # builds all four layers
    for r, e in zip(read, eager):
        assert r["load"] >= 3.5 * _LAYER_MB, (r, e)
        assert e["first"] - r["first"] >= 2.5 * _LAYER_MB, (r, e)


BAD = r"""
import json, sys
import torch, torch.nn as nn
import smp

case = sys.argv[1]
smp.init({"partitions": 2, "microbatches": 1})


class MakesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if not hasattr(self, "scale"):
            self.scale = nn.Parameter(torch.ones(4))
        return self.fc(x) * self.scale


class Undecodable(nn.Linear):
    def forward(self, x):  # an exception whose type a message alone cannot make
        raise UnicodeDecodeError("utf-8", b"\\xff", 0, 1, "a label that is not UTF-8")


with smp.delay_param_initialization():
    if case == "forward":
        net = nn.Sequential(nn.Linear(4, 4), MakesInForward())
    elif case == "undecodable":
        net = nn.Sequential(nn.Linear(4, 4), Undecodable(4, 4))
    elif case == "budget":  # 2 x 16 MiB of weights per rank: 128 MiB with AdamW
        net = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
    else:
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
model = smp.DistributedModel(net)

@smp.step
def run(x):
    return model(x)

try:
    if case == "state_dict":
        model.state_dict()
    elif case == "shape":
        model.load_state_dict({"0.weight": torch.zeros(4, 4), "0.bias": torch.zeros(4),
                               "1.weight": torch.zeros(4, 5), "1.bias": torch.zeros(4)})
        run(torch.ones(2, 4))
    elif case == "budget":
        import resource
        with open("/proc/self/status") as f:
            vm_data = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmData:"))
        limit = vm_data + 96 * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
        opt = smp.DistributedOptimizer(torch.optim.AdamW(net.parameters()))
        run(torch.ones(2, 2048))
    elif case == "adagrad":
        opt = smp.DistributedOptimizer(torch.optim.Adagrad(net.parameters()))
        run(torch.ones(2, 4))
    else:
        run(torch.ones(2, 4))
except (RuntimeError, MemoryError) as e:
    print("ERROR", type(e).__name__, e)
smp.shutdown()
"""


@needs_torch_2
@pytest.mark.parametrize("case,text", [
    ("forward", "smp.delay_param_initialization: the model created ['1.scale'] in forward"),
    ("state_dict", "smp: state_dict() of a model built under smp.delay_param_initialization "
                   "has no values before the first step"),
    ("shape", "smp: load_state_dict: tensors whose shape differs from the model's: "
              "'1.weight': checkpoint [4, 5], model [4, 4]"),
    ("undecodable", "a label that is not UTF-8 (tracing the first step in module '1' "
                    "(Undecodable), at "),
    ("budget", "MemoryError smp: this rank's part of the model needs 0.13 GiB for its "
               "training state (8.4M parameters with their gradients and AdamW's 2 state "
               "tensors) but the process may allocate"),
    ("adagrad", "smp: optimizer Adagrad made its state 'sum' from the model's parameters "
                "before smp.DistributedModel materialized them"),
])
def test_bad_input_is_named_on_every_rank(ranks, case, text):
    for r in ranks(BAD, 2, args=(case,), timeout=90):
        assert r.returncode == 0, r
        assert text in r.stdout, r


@pytest.mark.skipif(TORCH_2, reason="torch >= 2.0 supports deferred init")
def test_torch_1_13_names_the_version_it_needs():
    import smp
    with pytest.raises(RuntimeError, match=r"smp.delay_param_initialization needs torch >= 2.0"):
        with smp.delay_param_initialization():
            pass


@needs_torch_2
def test_a_recording_lives_exactly_as_long_as_its_storages():
    # Note [Recording's lifetime]: a recording (and any real tensor its operations copied
    # from) is dropped once no tensor uses its storages any more.
    import gc
    import smp
    from smp import deferred_init
    gc.collect()
    before = len(deferred_init._RECORDINGS)
    source = torch.randn(4, 4)
    with smp.delay_param_initialization():
        m = torch.nn.Linear(4, 4)
        with torch.no_grad():
            m.weight.copy_(source)  # the recording holds `source` for the replay
        extra = torch.ones(3) * 2
    assert len(deferred_init._RECORDINGS) == before + 1
    import weakref
    source_ref = weakref.ref(source)
    del source
    gc.collect()
    assert source_ref() is not None, "the replay still needs the tensor copied from"
    deferred_init.materialize(m)
    assert torch.equal(m.weight, source_ref())
    gc.collect()
    assert len(deferred_init._RECORDINGS) == before + 1, "`extra` still uses a storage"
    assert deferred_init._recording_of(extra) is not None
    del extra
    gc.collect()
    assert len(deferred_init._RECORDINGS) == before
    assert source_ref() is None, "the dropped recording released what it held"
    # A meta tensor made afterwards is not taken for a recorded one.
    assert deferred_init._recording_of(torch.empty(3, device="meta")) is None
