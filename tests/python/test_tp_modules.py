"""smp.nn's distributed modules at tp=2 against their reference modules in one process
(tests/python/tp_reference.py), forward and backward within 1e-5 in fp32, dropout on
under a fixed seed: with each tp rank reading its own batch (the reference sees both
ranks' batches) and with prescaled_batch (both read the same batch). The weights come
from the same seed, not from a copy: each rank's slice must equal the reference's."""
import json
import os

from tp_reference import case_outputs, one_job

MODULES = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import torch, torch.distributed as dist
import smp, tp_reference as ref

prescaled = sys.argv[1] == "prescaled"
smp.init({"ddp": True, "tensor_parallel_degree": 2, "prescaled_batch": prescaled,
          "timeout_s": 60})
tp, me = smp.tp_size(), smp.tp_rank()
group = smp.get_tp_process_group()
N, S, H, HEADS, I, V = 2, 6, 16, 4, 32, 50
out = {}

def rows(t):  # this rank's part of the group's batch
    return t if prescaled or t.shape[0] != tp * N else t[me * N:(me + 1) * N]

def whole(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((N if prescaled else tp * N,) + shape, generator=g)

def check(name, make_dist, make_ref, inputs, grad_of=(0,), out_index=None):
    torch.manual_seed(7)
    d = make_dist()
    torch.manual_seed(7)
    r = make_ref()
    # Weights: the reference's slice (distributed) or whole (replicated).
    rp = dict(r.named_parameters())
    wdiff = 0.0
    for n, p in d.named_parameters():
        full = rp[n]  # the reference's names
        if hasattr(p, "_smp_tp_dim"):
            start, length = p._smp_tp_slice
            full = full.narrow(p._smp_tp_dim, start, length)
        wdiff = max(wdiff, (full - p).abs().max().item())
    d.train(); r.train()
    xs_d = [rows(x).clone().requires_grad_(x.is_floating_point() and i in grad_of)
            if isinstance(x, torch.Tensor) else x for i, x in enumerate(inputs)]
    xs_r = [x.clone().requires_grad_(x.is_floating_point() and i in grad_of)
            if isinstance(x, torch.Tensor) else x for i, x in enumerate(inputs)]
    torch.manual_seed(11)
    yd = d(xs_d[0] if len(xs_d) == 1 else tuple(xs_d))
    torch.manual_seed(11)
    yr = r(xs_r[0] if len(xs_r) == 1 else tuple(xs_r))
    if out_index is not None:
        yd, yr = yd[out_index], yr[out_index]
    g = torch.Generator().manual_seed(3)
    gy = torch.randn(yr.shape, generator=g)
    (yd * rows(gy)).sum().backward()
    (yr * gy).sum().backward()
    fdiff = (yd - rows(yr)).abs().max().item()
    gdiff = 0.0
    for i in grad_of:
        gdiff = max(gdiff, (xs_d[i].grad - rows(xs_r[i].grad)).abs().max().item())
    for n, p in d.named_parameters():
        full = rp[n].grad
        grad = p.grad
        if hasattr(p, "_smp_tp_dim"):
            start, length = p._smp_tp_slice
            full = full.narrow(p._smp_tp_dim, start, length)
        elif not prescaled:  # a replicated parameter saw this rank's rows only
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
        gdiff = max(gdiff, (full - grad).abs().max().item())
    out[name] = [wdiff, fdiff, gdiff]

mask = torch.zeros((N if prescaled else tp * N), 1, 1, S)
mask[0, ..., -2:] = -10000.0
mask[-1, ..., :1] = -10000.0
kw = dict(num_attention_heads=HEADS, attention_head_size=H // HEADS, hidden_size=H,
          attention_dropout_prob=0.2, hidden_dropout_prob=0.3)
check("linear", lambda: smp.nn.DistributedLinear(H, 8), lambda: torch.nn.Linear(H, 8),
      [whole((S, H), 1)])
ids = torch.randint(0, V, ((N if prescaled else tp * N), S), generator=torch.Generator().manual_seed(5))
check("embedding", lambda: smp.nn.DistributedEmbedding(V, H),
      lambda: ref.embedding(V, H), [ids], grad_of=())
for pre, post, causal in [(False, True, None), (True, False, S), (True, True, S)]:
    a = dict(kw, pre_layernorm=pre, post_layernorm=post, causal_mask_size=causal)
    check(f"attention pre={pre} post={post}", lambda: smp.nn.DistributedAttentionLayer(**a),
          lambda: ref.Attention(**a), [whole((S, H), 2), mask])
    o = dict(hidden_size=H, intermediate_size=I, hidden_dropout_prob=0.3, activation="gelu_new",
             pre_layernorm=pre, post_layernorm=post)
    check(f"output pre={pre} post={post}", lambda: smp.nn.DistributedTransformerOutputLayer(**o),
          lambda: ref.Output(**o), [whole((S, H), 3)])
cross = dict(kw, cross_attention=True)
check("cross attention", lambda: smp.nn.DistributedAttentionLayer(**cross),
      lambda: ref.Attention(**cross), [whole((S, H), 4), whole((S + 2, H), 5),
                                       torch.zeros(1, 1, 1, S + 2)], grad_of=(0, 1))
lay = dict(kw, intermediate_size=I, activation="relu")
check("layer", lambda: smp.nn.DistributedTransformerLayer(**lay), lambda: ref.Layer(**lay),
      [whole((S, H), 6), mask], out_index=0)
st = dict(kw, intermediate_size=I, num_layers=2, pre_layernorm=True, post_layernorm=True,
          causal_mask_size=S)
check("transformer", lambda: smp.nn.DistributedTransformer(**st),
      lambda: ref.Transformer(**st), [whole((S, H), 7), mask], out_index=0)
lm = dict(st, vocab_size=V, num_positions=S, activation="gelu_new")
pad = torch.zeros((N if prescaled else tp * N), S)
pad[-1, -1] = 1
check("lm head", lambda: smp.nn.DistributedTransformerLMHead(**lm), lambda: ref.LMHead(**lm),
      [ids, pad, None, None, ids], grad_of=(), out_index=1)
print("MODULES " + json.dumps(out), flush=True)
"""


BAD = r"""
import sys
import torch
import smp

smp.init({"ddp": True, "tensor_parallel_degree": 2, "timeout_s": 30})
cases = {
    "heads": lambda: smp.nn.DistributedAttentionLayer(num_attention_heads=3,
                                                      attention_head_size=4, hidden_size=12),
    "intermediate": lambda: smp.nn.DistributedTransformerOutputLayer(hidden_size=8,
                                                                     intermediate_size=33),
    "linear": lambda: smp.nn.DistributedLinear(7, 4),
    "embedding": lambda: smp.nn.DistributedEmbedding(10, 5),
    "activation": lambda: smp.nn.DistributedTransformerOutputLayer(hidden_size=8,
                                                                   intermediate_size=8,
                                                                   activation="swish"),
}
for name, make in cases.items():
    try:
        make()
        print("NO ERROR", name, flush=True)
    except smp.ConfigError as e:
        print("ERROR", name, e, flush=True)
# Each tp rank's batch must have the same shape: an error on both ranks, not a hang.
lin = smp.nn.DistributedLinear(8, 4)
try:
    lin(torch.randn(2 + smp.tp_rank(), 8))
    print("NO ERROR shapes", flush=True)
except smp.ConfigError as e:
    print("ERROR shapes", e, flush=True)
"""


def test_modules_equal_their_reference_at_tp2_and_bad_inputs_are_errors(ranks):
    # One job (tp_reference.one_job): each tp rank's own batch, prescaled_batch, then
    # the bad inputs, and the comm hook refused with slices.
    here = os.path.dirname(os.path.abspath(__file__))
    res = ranks(one_job([(MODULES, ("own", here)), (MODULES, ("prescaled", here)),
                         (BAD, ()), (REFUSED, ())]), 2, check=False, timeout=300)
    for r in res:
        assert r.returncode == 3, (r.stdout, r.stderr[-3000:])
        mods = case_outputs(r.stdout, "MODULES")
        for got in mods[:2]:
            assert got is not None and len(got) == 12, r.stdout
            for name, (wdiff, fdiff, gdiff) in got.items():
                assert wdiff == 0.0, (name, "weights", wdiff)
                assert fdiff < 1e-5, (name, "forward", fdiff)
                assert gdiff < 1e-5, (name, "backward", gdiff)
        bad = r.stdout.split("\nCASE 2\n", 1)[1].split("\nCASE 3\n", 1)
        _check_bad(bad[0])
        _check_refused(bad[1])


def _check_bad(stdout):
    needles = {
        "heads": "DistributedAttentionLayer num_attention_heads=3 is not divisible by "
                 "'tensor_parallel_degree'=2",
        "intermediate": "DistributedTransformerOutputLayer intermediate_size=33 is not "
                        "divisible by 'tensor_parallel_degree'=2",
        "linear": "DistributedLinear in_features=7 is not divisible",
        "embedding": "DistributedEmbedding embedding_dim=5 is not divisible",
        "activation": "activation='swish' is not allowed (allowed: gelu, gelu_new, relu)",
        "shapes": "the ranks of a tp group bring inputs of different shapes (tp rank 0: "
                  "[2, 8], tp rank 1: [3, 8])",
    }
    for name, needle in needles.items():
        line = [l for l in stdout.splitlines() if l.split()[:2] in (["ERROR", name],
                                                                  ["NO", "ERROR"])
                and name in l.split()[:3]]
        assert line and line[0].startswith("ERROR") and needle in line[0], (name, stdout)


REFUSED = r"""
import sys
import torch, torch.nn as nn
import smp
from smp.ddp_comm_hooks import DDPCommHookType, register_ddp_comm_hook

smp.init({"ddp": True, "tensor_parallel_degree": 2, "timeout_s": 30})
net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
net[0].weight._smp_tp_dim = 0
net[0].weight._smp_tp_full_shape = (8, 4)
try:
    model = smp.DistributedModel(net)
    register_ddp_comm_hook(DDPCommHookType.POWER_SGD, model)
except smp.ConfigError as e:
    print("ERROR", e, flush=True)
    sys.exit(3)
print("NO ERROR", flush=True)
"""


def _check_refused(stdout):
    # (moved from test_tp_reduction.py) A comm hook with tp slices is refused on every
    # rank of the single-rank world of each tp group: dp = tp = 2, rdp = 1.
    # (Optimizer-state sharding with slices works: test_tp_training.py's tp2xrdp2-sharded.)
    want = ["comm hook 'powerSGD_hook'", "_smp_tp_dim", "rdp group"]
    assert all(w in stdout for w in want), stdout
