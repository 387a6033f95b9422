"""Checkpoints under tensor parallelism (issue 41; Note [Slices in checkpoints] in
smp/tp_state.py, docs/checkpoint.md "Tensor parallelism"): a full save at tp=2 holds
full tensors under the module's names (it loads strictly into the reference LM head of
tests/python/tp_reference.py, and a substituted Hugging Face GPT-2's into the plain
GPT-2); a partial save at tp=2 resumes bitwise; a save at tp=2 resumes at tp=1 and one
at tp=1 at tp=2 (Adam's state sliced like its parameters), and training goes on as
without resharding (1e-6); pp x tp changes reshard too; `python -m smp.checkpoint
merge` concatenates the slices. A substituted nn.Linear keeps nn.Linear's names, and
saves under smp's former names (linear.weight) still load. A sharded optimizer
(shard_optimizer_state) at tp=2 x rdp=2: a partial save resumes bitwise, a full one at
tp=1 and back at tp=2 (1e-6, optimizer state included); its partial saves (gathered
local state, shares) read with smp.load(partial=True) give each tp rank its own slices'
optimizer state (bitwise, also at tp=1, and a tp=2 x pp=2 one at tp=2 x pp=2 with
the layers on other stages, whose missing entries are exchanged)."""
import importlib.util
import json
import os
import subprocess
import sys

import torch

from tp_reference import case_outputs, one_job

HERE = os.path.dirname(os.path.abspath(__file__))

PRELUDE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[2])
import torch, torch.distributed as dist
import smp, tp_reference as ref

opts = json.loads(sys.argv[1])
D = opts["dir"]
N, S, V = 4, 8, 32
KW = dict(num_layers=2, num_attention_heads=4, attention_head_size=4, hidden_size=16,
          intermediate_size=32, vocab_size=V, num_positions=S, attention_dropout_prob=0.0,
          hidden_dropout_prob=0.0, activation="gelu_new", causal_mask_size=S,
          pre_layernorm=True, post_layernorm=True)


def start(tp, seed=0, pp=1, shard=False, stages=None):
    # stages: each layer's pp rank, placed by hand (else auto_partition's)
    smp.init({"ddp": True, "tensor_parallel_degree": tp, "partitions": pp,
              "microbatches": pp, "shard_optimizer_state": shard, "timeout_s": 60,
              **({"auto_partition": False} if stages else {})})
    torch.manual_seed(seed)
    model = smp.DistributedModel(smp.nn.DistributedTransformerLMHead(**KW))
    if pp > 1:
        for i, layer in enumerate(model.get_module().transformer.seq_layers.children()):
            smp.set_partition(layer, stages[i] if stages else i % pp)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @smp.step
    def step(ids):
        loss, _ = model((ids, None, None, None, ids))
        model.backward(loss)
        return loss

    def train(i):
        # the world's batch is 2N rows whatever the layout, split over the dp group
        ids = batch(i)
        me, n = smp.dp_rank(), 2 * N // smp.dp_size()
        out = step(ids[n * me:n * (me + 1)])
        opt.step()
        opt.zero_grad()
        loss = out.reduce_mean().detach().clone()
        dist.all_reduce(loss, group=smp.get_dp_process_group())
        return loss.item() / smp.dp_size()
    return model, opt, train


def batch(i):
    return torch.randint(0, V, (2 * N, S), generator=torch.Generator().manual_seed(i))


def emit(tag, obj):
    print(tag + " " + json.dumps(obj), flush=True)


def check_same_opt(got, want, what):
    # full positional optimizer states equal bitwise (naming the entry that is not)
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for i, st in want.items():
        assert sorted(got[i]) == sorted(st), (what, i)
        for k, v in st.items():
            assert torch.equal(got[i][k], v), (what, "optimizer state", i, k)
"""

FULL = PRELUDE + r"""
model, opt, train = start(2)
for i in range(2):
    train(i)
smp.save_checkpoint(D, "full", partial=False)
full = model.state_dict()  # every rank: the gathered full tensors
out = {"keys_match": None, "slices_equal": True}
for name, p in model.local_named_parameters():
    want = full[name]
    if hasattr(p, "_smp_tp_dim"):
        start, length = p._smp_tp_slice
        out["sliced"] = True
        want = want.narrow(p._smp_tp_dim, start, length)
    out["slices_equal"] &= torch.equal(p.detach().cpu(), want)
if smp.rank() == 0:
    reference = ref.LMHead(**KW)
    reference.load_state_dict(torch.load(os.path.join(D, "full")), strict=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_opt.load_state_dict(torch.load(os.path.join(D, "full.optimizer")))
    out["keys_match"] = sorted(torch.load(os.path.join(D, "full"))) == \
        sorted(reference.state_dict())
    ids = batch(2)
    parts = [reference((c, None, None, None, c))[0] for c in ids.split(N)]
    ref_loss = (sum(parts) / len(parts))
    ref_loss.backward()
    ref_opt.step()
    out["ref_loss"] = ref_loss.item()
    out["ref_after"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
loss = train(2)
after = model.state_dict()
if smp.rank() == 0:
    out["loss"] = loss
    # (attention.key.bias: its gradient is zero in exact arithmetic, and Adam makes
    # steps of its rounding; see _close)
    out["after_diff"] = max((after[k] - v).abs().max().item()
                            for k, v in out.pop("ref_after").items()
                            if not k.endswith("attention.key.bias"))
emit("FULL", out)
"""


def _check_full(outs):
    for out in outs:
        assert out["sliced"] and out["slices_equal"], out
    # rank 0: the reference took the model and Adam's state; one more step of each agrees
    out = outs[0]
    assert out["keys_match"]
    assert abs(out["loss"] - out["ref_loss"]) < 1e-6, out
    assert out["after_diff"] < 1e-6, out


HF = PRELUDE + r"""
import transformers as tf


def gpt2():
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


smp.init({"ddp": True, "tensor_parallel_degree": 2, "timeout_s": 60})
plain = gpt2()
with smp.model_creation(tensor_parallelism=True):
    net = gpt2()
model = smp.DistributedModel(net)
assert type(model.get_module()).__name__ == "DistributedTransformerLMHead"
opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)


@smp.step
def step(ids):
    loss = model(input_ids=ids, labels=ids)["loss"]
    model.backward(loss)
    return loss


for i in range(2):
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(i))
    step(ids[2 * smp.dp_rank():2 * smp.dp_rank() + 2])
    opt.step()
    opt.zero_grad()
    halves = [plain(input_ids=c, labels=c)["loss"] for c in ids.split(2)]
    (sum(halves) / 2).backward()
    plain_opt.step()
    plain_opt.zero_grad()
smp.save_checkpoint(D, "hf", partial=False, optimizer=None)
out = {}
if smp.rank() == 0:
    saved = torch.load(os.path.join(D, "hf"))
    loaded = gpt2()
    loaded.load_state_dict(saved, strict=True)  # Hugging Face's names, full tensors
    want = plain.state_dict()
    out["keys"] = sorted(saved) == sorted(want)
    out["diff"] = max((loaded.state_dict()[k].float() - v.float()).abs().max().item()
                      for k, v in want.items())
# ... and it loads back into the substituted model (translated to smp's names, cut)
before = {k: v.clone() for k, v in model.state_dict().items()}
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
smp.resume_from_checkpoint(D, "hf", partial=False, load_optimizer=False)
back = model.state_dict()
out["round_trip"] = sorted(back) == sorted(before) and all(
    torch.equal(back[k], before[k]) for k in before)
emit("HF", out)
"""


def _check_hf(outs):
    assert outs[0]["keys"], outs[0]
    assert outs[0]["diff"] < 1e-5, outs[0]
    assert all(o["round_trip"] for o in outs), outs


PARTIAL = PRELUDE + r"""
model, opt, train = start(2)
for i in range(3):
    train(i)
smp.save_checkpoint(D, "p", partial=True)
full, full_opt = model.state_dict(), opt.state_dict()  # collective
if smp.rank() == 0:
    torch.save(full, os.path.join(D, "full_at_save.pt"))
    torch.save(full_opt, os.path.join(D, "opt_at_save.pt"))
a_losses = [train(i) for i in range(3, 6)]
a = {k: v.detach().clone() for k, v in model.local_named_parameters()}
a_opt = opt.state_dict()  # full
smp.shutdown()

model, opt, train = start(2, seed=1)  # other weights: the resume must replace them
smp.resume_from_checkpoint(D, partial=True)
b_losses = [train(i) for i in range(3, 6)]
b = {k: v.detach().clone() for k, v in model.local_named_parameters()}
b_opt = opt.state_dict()
same_opt = all(torch.equal(a_opt["state"][i][k], b_opt["state"][i][k])
               for i in a_opt["state"] for k in a_opt["state"][i])
emit("PARTIAL", {"losses": a_losses == b_losses, "params": all(torch.equal(a[k], b[k])
                 for k in a), "opt": same_opt, "files": sorted(os.listdir(
                     os.path.join(D, "p_partial")))})
"""


def _check_partial(outs, tmp_path):
    for out in outs:
        assert out["losses"] and out["params"] and out["opt"], out
        # one part per (pp rank, tp rank)
        assert [f for f in out["files"] if f.startswith(("model", "optimizer"))] == \
            ["model_0", "model_1", "optimizer_0", "optimizer_1"], out
    # python -m smp.checkpoint merge: the slices concatenated, the reference's names
    d = tmp_path / "p_partial"
    env = dict(os.environ)
    for what in ("model", "optimizer"):
        subprocess.run([sys.executable, "-m", "smp.checkpoint", "merge", str(d / what),
                        str(tmp_path / f"{what}.pt")], check=True, env=env, timeout=60)
    merged = torch.load(tmp_path / "model.pt")
    full = torch.load(tmp_path / "full_at_save.pt")
    assert sorted(merged) == sorted(full)
    assert all(torch.equal(merged[k], full[k]) for k in full)
    sys.path.insert(0, HERE)
    import tp_reference as ref
    kw = dict(num_layers=2, num_attention_heads=4, attention_head_size=4, hidden_size=16,
              intermediate_size=32, vocab_size=32, num_positions=8,
              attention_dropout_prob=0.0, hidden_dropout_prob=0.0, activation="gelu_new",
              causal_mask_size=8, pre_layernorm=True, post_layernorm=True)
    ref.LMHead(**kw).load_state_dict(merged, strict=True)
    opt = torch.load(tmp_path / "optimizer.pt", weights_only=False)
    torch_opt = torch.load(tmp_path / "opt_at_save.pt")
    names = [n for n, _ in ref.LMHead(**kw).named_parameters()]
    for i, n in enumerate(names):
        for k, v in torch_opt["state"][i].items():
            assert torch.equal(opt["state"][n][k], v), (n, k)


LINEAR = PRELUDE + r"""
# nn.Linear substituted by DistributedLinear keeps nn.Linear's names (weight, bias) in
# state dicts, checkpoints and the optimizer's state; names smp used before
# (linear.weight, linear.bias) still load.
smp.init({"ddp": True, "tensor_parallel_degree": 2, "timeout_s": 60})


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))


plain = net()
with smp.tensor_parallelism():
    sub = net()
model = smp.DistributedModel(sub)
opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
out = {"types": [type(m).__name__ for m in model.get_module()]}
want = plain.state_dict()
full = model.state_dict()
out["keys"] = list(full) == list(want)
fresh = net()
fresh.load_state_dict(full, strict=True)
out["values"] = all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
special = {"_smp_is_partial", "_smp_tp"}
local = model.local_state_dict()
out["local_keys"] = sorted(k for k in local if k not in special) == sorted(want)
out["table"] = sorted(local["_smp_tp"]["slices"])
out["params"] = [n for n, _ in model.named_parameters()]


@smp.step
def step(x):
    loss = model(x).pow(2).mean()
    model.backward(loss)
    return loss


x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
step(x[2 * smp.dp_rank():2 * smp.dp_rank() + 2])
opt.step()
opt.zero_grad()
osd = opt.local_state_dict()
out["opt_keys"] = sorted(osd["state"]) == sorted(n for n, _ in plain.named_parameters())
smp.save_checkpoint(D, "lin", partial=False)
smp.save_checkpoint(D, "lin", partial=True)
if smp.rank() == 0:
    saved = torch.load(os.path.join(D, "lin"))
    out["saved_keys"] = list(saved) == list(want)
    net().load_state_dict(saved, strict=True)

# A checkpoint written before the rename: the same files under the old names.
old = lambda n: n.replace("weight", "linear.weight").replace("bias", "linear.bias")
o_local = {old(k): v for k, v in local.items() if k not in special}
o_local["_smp_is_partial"] = False
o_local["_smp_tp"] = dict(local["_smp_tp"], slices={old(k): v for k, v in
                                                    local["_smp_tp"]["slices"].items()})
o_opt = dict(osd, state={old(k): v for k, v in osd["state"].items()},
             param_groups=[dict(g, params=[old(n) for n in g["params"]])
                           for g in osd["param_groups"]])
o_opt["_smp_tp"] = dict(osd["_smp_tp"], slices={old(k): v for k, v in
                                                osd["_smp_tp"]["slices"].items()})
d = os.path.join(D, "lin_partial")
smp.save(o_local, os.path.join(d, "model"), partial=True)
smp.save(o_opt, os.path.join(d, "optimizer"), partial=True)
before = {k: v.clone() for k, v in model.local_state_dict().items() if k not in special}
opt_before = opt.state_dict()
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
opt.state.clear()
smp.resume_from_checkpoint(D, "lin", partial=True)
after = model.local_state_dict()
opt_after = opt.state_dict()
out["old_partial"] = all(torch.equal(after[k], v) for k, v in before.items()) and all(
    torch.equal(opt_after["state"][i][k], v) for i, s in opt_before["state"].items()
    for k, v in s.items())
# ... and a full one (a plain torch.save of the full dict)
if smp.rank() == 0:
    torch.save({old(k): v for k, v in full.items()}, os.path.join(D, "lin_old"))
smp.barrier()
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
smp.resume_from_checkpoint(D, "lin_old", partial=False, load_optimizer=False)
out["old_full"] = all(torch.equal(model.state_dict()[k], v) for k, v in full.items())
emit("LINEAR", out)
"""


def _check_linear(outs):
    for out in outs:
        assert out["types"] == ["DistributedLinear", "ReLU", "DistributedLinear"], out
        assert out["keys"] and out["values"] and out["local_keys"] and out["opt_keys"], out
        assert out["table"] == ["0.weight", "2.weight"], out
        assert out["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"], out
        assert out["old_partial"] and out["old_full"], out
    assert outs[0]["saved_keys"], outs[0]


def test_full_and_partial_saves_at_tp2(ranks, tmp_path):
    # One job (tp_reference.one_job): the full save loading strictly into the
    # reference, the partial save resuming bitwise (and merged by the CLI below), and,
    # with transformers installed, a substituted GPT-2's full save loading into the
    # plain GPT-2.
    args = (json.dumps({"dir": str(tmp_path)}), HERE)
    cases = [(FULL, args), (PARTIAL, args), (LINEAR, args)]
    hf = importlib.util.find_spec("transformers") is not None
    if hf:
        cases.append((HF, args))
    res = ranks(one_job(cases), 2, timeout=120 * len(cases))
    outs = {tag: [case_outputs(r.stdout, tag)[k] for r in res]
            for k, tag in enumerate(["FULL", "PARTIAL", "LINEAR", "HF"][:len(cases)])}
    assert all(all(o) for o in outs.values()), [r.stdout for r in res]
    _check_full(outs["FULL"])
    _check_partial(outs["PARTIAL"], tmp_path)
    _check_linear(outs["LINEAR"])
    if hf:
        _check_hf(outs["HF"])


RESHARD = PRELUDE + r"""
STEPS = opts["steps"]
tps, pps = opts["tps"], opts["pps"]
stage = opts["stage"]
seed = opts["stage_index"]
model, opt, train = start(tps[stage], seed=seed, pp=pps[stage])
if stage > 0:
    smp.resume_from_checkpoint(D, tag=f"s{stage - 1}", partial=True)
lo, hi = STEPS[stage]
losses = [train(i) for i in range(lo, hi)]
if stage < len(tps) - 1:
    smp.save_checkpoint(D, f"s{stage}", partial=True)
    if opts.get("continue"):
        # the run without resharding: the same job goes on
        losses += [train(i) for i in range(hi, opts["continue"])]
full = model.state_dict()
emit("RESHARD", {"losses": losses, "state": {k: v.flatten().tolist() for k, v in
                                             full.items()} if smp.rank() == 0 else None})
"""


def _reshard(ranks, tmp_path, layouts, steps_per_stage=2, extra=None):
    """Stage i runs layout (world, tp, pp) i, resuming the previous stage's partial
    save; the first stage also runs on to the end unresharded. `extra` {world: [case
    script]}: more cases for the job of that world, after its stages (given the
    job's options). Returns (resharded losses and final state, unresharded ones)."""
    extra = dict(extra or {})
    worlds = [w for w, _, _ in layouts]
    tps = [t for _, t, _ in layouts]
    pps = [p for _, _, p in layouts]
    steps = [(i * steps_per_stage, (i + 1) * steps_per_stage) for i in range(len(layouts))]
    got_losses, base = [], None
    # Consecutive stages of one world size run as one job (tp_reference.one_job).
    groups = []
    for stage in range(len(layouts)):
        if groups and worlds[groups[-1][-1]] == worlds[stage]:
            groups[-1].append(stage)
        else:
            groups.append([stage])
    outs = []
    for group in groups:
        cases = []
        for stage in group:
            opts = {"dir": str(tmp_path), "tps": tps, "pps": pps, "stage": stage,
                    "stage_index": stage, "steps": steps}
            if stage == 0:
                opts["continue"] = steps[-1][1]
            cases.append((RESHARD, (json.dumps(opts), HERE)))
        more = extra.pop(worlds[group[0]], [])
        cases += [(script, (json.dumps({"dir": str(tmp_path)}), HERE)) for script in more]
        res = ranks(one_job(cases), worlds[group[0]], timeout=120 * len(cases))
        outs += case_outputs(res[0].stdout, "RESHARD")[:len(group)]
        for r in res:
            assert r.stdout.count("\nSHARDED ok") == len(more), (r.stdout, r.stderr[-3000:])
    assert len(outs) == len(layouts) and all(outs), outs
    for stage, out in enumerate(outs):
        if stage == 0:
            base = out
            got_losses += out["losses"][:steps_per_stage]
        else:
            got_losses += out["losses"]
            final = out["state"]
    return got_losses, final, base["losses"], base["state"]


def _close(got_losses, final, want_losses, want_state):
    assert len(got_losses) == len(want_losses)
    for a, b in zip(got_losses, want_losses):
        assert abs(a - b) < 1e-6, (got_losses, want_losses)
    assert sorted(final) == sorted(want_state)
    for k, v in want_state.items():
        if k.endswith("attention.key.bias"):
            # Its gradient is zero in exact arithmetic (softmax ignores a shift shared
            # by a query's scores); Adam turns the rounding left in it into steps.
            continue
        d = max(abs(x - y) for x, y in zip(final[k], v))
        assert d < 1e-6, (k, d)


def test_tp2_to_tp1_to_tp2_continues_as_without_resharding(ranks, tmp_path):
    _close(*_reshard(ranks, tmp_path, [(2, 2, 1), (2, 1, 1), (2, 2, 1)]))


SHARDED_TP2 = PRELUDE + r"""
# shard_optimizer_state at tp=2 x rdp=2 (Note [Sharded tp slices]): a partial save
# resumes bitwise; a full save is resumed at tp=1 by SHARDED_TP1. smp.load(partial=True)
# + opt.load_state_dict of the gathered local state (SMP v1's way) and of the shares
# save_checkpoint wrote give each tp rank its own slices' state, bitwise.
model, opt, train = start(2, shard=True)
assert smp.rdp_size() == 2
for i in range(2):
    train(i)
smp.save_checkpoint(D, "sh", partial=True)
smp.save(opt.local_state_dict(), os.path.join(D, "sh_local"), partial=True)
saved_opt = opt.state_dict()["state"]  # full: the uninterrupted run's at the save
smp.save_checkpoint(D, "sh_full", partial=False)
a_losses = [train(i) for i in range(2, 4)]
a = {k: v.detach().clone() for k, v in model.local_named_parameters()}
a_opt = opt.state_dict()  # full
a_full = model.state_dict()
smp.shutdown()

model, opt, train = start(2, seed=1, shard=True)
smp.resume_from_checkpoint(D, "sh", partial=True)
b_losses = [train(i) for i in range(2, 4)]
b = {k: v.detach().clone() for k, v in model.local_named_parameters()}
b_opt = opt.state_dict()
assert a_losses == b_losses, (a_losses, b_losses)
assert all(torch.equal(a[k], b[k]) for k in a), "parameters differ after the resume"
assert sorted(a_opt["state"]) == sorted(b_opt["state"])
for i, st in a_opt["state"].items():
    for k, v in st.items():
        assert torch.equal(v, b_opt["state"][i][k]), ("optimizer state", i, k)
# (loaded over the state of two more steps, so a load that keeps it shows)
for f in ("sh_local", "sh_partial/optimizer"):
    opt.load_state_dict(smp.load(os.path.join(D, f), partial=True))
    check_same_opt(opt.state_dict()["state"], saved_opt, f)
if smp.rank() == 0:
    names = [n for n, _ in model.get_module().named_parameters()]
    torch.save({"losses": a_losses, "state": a_full, "names": names,
                "opt": a_opt["state"], "saved_opt": saved_opt}, os.path.join(D, "sh_want.pt"))
smp.shutdown()

# A partial save at tp=2 x pp=2 (gathered local state) read at tp=2 x pp=2 with the
# layers placed by hand (both on one stage): a stage lacks entries its part does not
# hold, exchanged over the world, and a slice's state only between ranks of one tp
# rank (a slice has one name and shape on every tp rank: by name alone a tp rank got
# another's piece of Adam's state). Loaded after a step (partitioned, not deferred).
model, opt, train = start(2, seed=4, pp=2, shard=True)
for i in range(2):
    train(i)
smp.save(opt.local_state_dict(), os.path.join(D, "sh_pp2"), partial=True)
saved_opt = opt.state_dict()["state"]
smp.shutdown()
model, opt, train = start(2, seed=5, pp=2, shard=True, stages=[1, 1])
train(0)
opt.load_state_dict(smp.load(os.path.join(D, "sh_pp2"), partial=True))
check_same_opt(opt.state_dict()["state"], saved_opt, "sh_pp2, other layers per stage")
print("SHARDED ok", flush=True)
"""

SHARDED_TP1 = PRELUDE + r"""
# SHARDED_TP2's full save resumed at tp=1 x rdp=2 (sharded): training goes on as
# without resharding; its own full save resumed at tp=2 x rdp=1 goes on as it does.
model, opt, train = start(1, seed=2, shard=True)
smp.resume_from_checkpoint(D, "sh_full", partial=False)
losses = [train(i) for i in range(2, 4)]
# (copies: at tp=1 the state dict's tensors are the parameters, which train on)
state = {k: v.clone() for k, v in model.state_dict().items()}
opt_state = opt.state_dict()["state"]
smp.save_checkpoint(D, "sh1_full", partial=False)
cont = [train(i) for i in range(4, 6)]
cont_state, cont_opt = model.state_dict(), opt.state_dict()["state"]
if smp.rank() == 0:
    torch.save({"losses": losses, "state": state, "opt": opt_state},
               os.path.join(D, "sh_tp1.pt"))
# SHARDED_TP2's tp=2 saves read with smp.load at tp=1: the slices' pieces concatenated
saved_opt = torch.load(os.path.join(D, "sh_want.pt"))["saved_opt"]
for f in ("sh_local", "sh_partial/optimizer"):
    opt.load_state_dict(smp.load(os.path.join(D, f), partial=True))
    check_same_opt(opt.state_dict()["state"], saved_opt, f + " at tp=1")
smp.shutdown()

model, opt, train = start(2, seed=3, shard=True)
smp.resume_from_checkpoint(D, "sh1_full", partial=False)
back = [train(i) for i in range(4, 6)]
back_state, back_opt = model.state_dict(), opt.state_dict()["state"]  # collective
if smp.rank() == 0:
    torch.save({"losses": cont, "state": cont_state, "opt": cont_opt, "back": back,
                "back_state": back_state, "back_opt": back_opt},
               os.path.join(D, "sh_back.pt"))
print("SHARDED ok", flush=True)
"""


def _close_sharded(got, want, names):
    """Losses, parameters (but attention.key.bias, see _close) and optimizer state
    within 1e-6."""
    assert len(got["losses"]) == len(want["losses"])
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) < 1e-6, (got["losses"], want["losses"])
    assert sorted(got["state"]) == sorted(want["state"])
    for k, v in want["state"].items():
        if not k.endswith("attention.key.bias"):
            assert (got["state"][k] - v).abs().max().item() < 1e-6, k
    assert sorted(got["opt"]) == sorted(want["opt"]) == list(range(len(names)))
    for i, st in want["opt"].items():
        assert sorted(got["opt"][i]) == sorted(st), names[i]
        for k, v in st.items():
            d = (got["opt"][i][k].float() - v.float()).abs().max().item()
            assert d < 1e-6, (names[i], k, d)


def test_tp2_pp2_to_tp1_pp1_reshards(ranks, tmp_path):
    # The same two launches (4 ranks, then 2) also run a sharded optimizer's saves:
    # tp=2 x rdp=2 partial and full, resumed at tp=2 x rdp=2 and at tp=1, and back;
    # the partial ones read with smp.load too, at tp=2 x rdp=2 and at tp=1.
    _close(*_reshard(ranks, tmp_path, [(4, 2, 2), (2, 1, 1)],
                     extra={4: [SHARDED_TP2], 2: [SHARDED_TP1]}))
    want = torch.load(tmp_path / "sh_want.pt")
    tp1 = torch.load(tmp_path / "sh_tp1.pt")
    _close_sharded(tp1, want, want["names"])
    back = torch.load(tmp_path / "sh_back.pt")
    _close_sharded({"losses": back["back"], "state": back["back_state"],
                    "opt": back["back_opt"]}, back, want["names"])
