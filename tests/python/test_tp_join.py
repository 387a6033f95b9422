"""Join (uneven inputs) under tensor parallelism: a DistributedTransformerLMHead at
tp=2 x rdp=2 where one replica (both its tp ranks) runs out of batches early trains
inside `model.join()` as the reference LM head (tests/python/tp_reference.py) trained
in one process on the batches of the replicas still training: each step's reduced
gradients (the divisor counts the active batches: Note [Slices reduce over their rdp
group]) and losses, and after the context every rank's parameters, the tp slices
taken from the last joiner of their rdp group (Note [Join under tensor parallelism] in
smp_core/join.cpp). A replica whose tp ranks run out apart is a ConfigError on every
rank."""
import json
import os

from tp_reference import case_outputs, one_job

TRAIN = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import torch
import smp, tp_reference as ref

opts = json.loads(sys.argv[1])
cfg = {"ddp": True, "tensor_parallel_degree": 2, "microbatches": 2, "timeout_s": 60}
cfg.update(opts.get("cfg", {}))
smp.init(cfg)
prescaled = bool(cfg.get("prescaled_batch"))
divide = opts["divide"]
N, S, V = 4, 8, 64
kw = dict(num_layers=2, num_attention_heads=4, attention_head_size=8, hidden_size=32,
          intermediate_size=64, vocab_size=V, num_positions=S, attention_dropout_prob=0.0,
          hidden_dropout_prob=0.0, activation="gelu_new", causal_mask_size=S,
          pre_layernorm=True, post_layernorm=True)
torch.manual_seed(0)
net = smp.nn.DistributedTransformerLMHead(**kw)
torch.manual_seed(0)
reference = ref.LMHead(**kw)
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

# A unit is one batch: a dp rank's own, or with prescaled_batch a replica's (rdp rank).
dp = smp.dp_size()
rdp_of = smp.allgather(smp.rdp_rank(), smp.CommGroup.DP_GROUP)  # per dp rank
units = smp.rdp_size() if prescaled else dp
steps_of_unit = [opts["steps"][u if prescaled else rdp_of[u]] for u in range(units)]
my_unit = smp.rdp_rank() if prescaled else smp.dp_rank()
my_steps = opts["steps"][smp.rdp_rank()] - (opts.get("tp1_short", 0) if smp.tp_rank() == 1 else 0)

def batch(i):
    return torch.randint(0, V, (N * units, S), generator=torch.Generator().manual_seed(i))

# The reference: step i trains on the units still active; the reducer divides by the
# active batches (divide_by_initial_world_size=False) or by all of them (True).
ref_grads, ref_losses, full = [], [], dict(reference.named_parameters())
for i in range(max(opts["steps"])):
    chunks = batch(i).split(N)
    parts, own = [], {}
    for u in range(units):
        if steps_of_unit[u] > i:
            halves = [reference((c, None, None, None, c))[0] for c in chunks[u].split(N // 2)]
            parts += halves
            own[u] = (sum(halves) / len(halves)).item()
    (sum(parts) / (2 * units if divide else len(parts))).backward()
    ref_grads.append({n: p.grad.clone() for n, p in full.items()})
    ref_losses.append(own)
    ref_opt.step(); ref_opt.zero_grad()

def mine(name, t):
    p = dict(model.local_named_parameters())[name]
    if hasattr(p, "_smp_tp_dim"):
        start, length = p._smp_tp_slice
        t = t.narrow(p._smp_tp_dim, start, length)
    return t

@smp.step
def step(ids):
    loss, _ = model((ids, None, None, None, ids))
    model.backward(loss)
    return loss

grad_diff, loss_diff = 0.0, 0.0
try:
    with model.join(divide_by_initial_world_size=divide):
        for i in range(my_steps):
            out = step(batch(i)[N * my_unit:N * (my_unit + 1)])
            for name, p in model.local_named_parameters():
                grad_diff = max(grad_diff,
                                (p.grad - mine(name, ref_grads[i][name])).abs().max().item())
            loss_diff = max(loss_diff, abs(out.reduce_mean().item() - ref_losses[i][my_unit]))
            opt.step(); opt.zero_grad()
except smp.ConfigError as e:
    print("ERROR " + json.dumps(str(e)), flush=True)
    sys.exit(3)

param_diff, worst = 0.0, None
for name, p in model.local_named_parameters():
    if name.endswith("attention.key.bias"):
        continue  # zero gradient in exact arithmetic (test_tp_training.py says why)
    d = (p.detach() - mine(name, full[name].detach())).abs().max().item()
    if d > param_diff:
        param_diff, worst = d, name
print("TRAIN " + json.dumps({"grad_diff": grad_diff, "loss_diff": loss_diff,
                             "param_diff": param_diff, "worst": worst}), flush=True)
"""

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_replica_running_out_early_trains_as_one_process_and_tp_ranks_apart_are_refused(
        ranks):
    # One job (tp_reference.one_job): the active divisor, prescaled_batch with the
    # initial divisor, then (last: it exits) the tp ranks of a replica running out apart.
    cases = [{"steps": [2, 5], "divide": False},
             {"steps": [5, 2], "divide": True, "cfg": {"prescaled_batch": True}},
             {"steps": [3, 3], "tp1_short": 1, "divide": True}]
    res = ranks(one_job([(TRAIN, (json.dumps(opts), HERE)) for opts in cases]), 4,
                check=False, timeout=300)
    for r in res:
        assert r.returncode == 3, (r.rank, r.stdout, r.stderr[-3000:])
        outs = case_outputs(r.stdout, "TRAIN")
        assert len(outs) == 3 and outs[2] is None, (r.rank, r.stdout)
        for opts, got in zip(cases[:2], outs[:2]):
            assert got is not None, (r.rank, opts, r.stdout, r.stderr[-3000:])
            # The reduced gradients of every step a rank ran, after the other replica
            # joined too (a wrong divisor would be off by 2x); Adam moves them apart a
            # little.
            assert got["grad_diff"] < 1e-5, (r.rank, opts, got)
            assert got["loss_diff"] < 1e-5, (r.rank, opts, got)
            # After the context every rank holds the last joiner's parameters.
            assert got["param_diff"] < 1e-4, (r.rank, opts, got)
        # A replica whose tp ranks run out apart: a ConfigError on every rank.
        text = json.loads(r.stdout.split("\nCASE 2\n", 1)[1].split("ERROR ", 1)[1]
                          .splitlines()[0])
        assert "'tensor_parallel_degree'=2" in text and "join" in text, text
        assert "same replica" in text, text
