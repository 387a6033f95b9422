"""Memory benchmark: a GPT whose one-process training state does not fit one rank's
budget trains at pp=4 under that budget, and each rank's peak memory against its share.

Model: GPT-style, vocabulary 32000, width 1024, 20 layers (tied head): ~284M
parameters, ~4.5 GB of training state with AdamW (16 bytes per parameter) in one
process. Built inside `smp.delay_param_initialization` (Note [Replayed init]); AdamW,
3 steps of 4 microbatches of 1 sequence of 64 tokens, one thread per rank.

Runs, each in fresh processes:
- `tiny`: the same job with a width-64 model: `floor_mb`, the baseline (code, threads,
  buffers) subtracted from every figure below.
- `pp4`: pp=4 with each rank's data segment limited (RLIMIT_DATA) to the baseline plus
  `--budget-gb` (default 3 GiB, below the 4.6 GB one process needs). Per rank:
  `peak_mb` = peak resident set minus the baseline's; `state_mb` = S, the parameters,
  gradients and AdamW state it holds; `activation_mb` = the bytes saved for backward
  at their peak (saved-tensor hooks); `ratio` = peak / (S + activations), target <= 1.3.
  The two ranks holding the tied embedding peak one copy of it (131 MB) higher: torch
  makes each later microbatch's gradient whole before adding it to .grad (Note [One
  gradient copy per weight] in smp_core/tied_grads.cpp; more in the first step).
  `ratio_max_foreach_off`: the same with AdamW(foreach=False): torch's default
  (foreach) AdamW step allocates temporaries the size of the rank's parameters.
- `pp1`: the same script with partitions=1 under the same limit: it must fail at once
  with smp's message naming the memory needed (Note [Memory budget]); `pp1_error` holds
  its first line and `pp1_seconds` how long it took to fail.
- `wrap_deferred_mb` / `wrap_eager_mb`: per rank, the peak resident set of building,
  wrapping and partitioning (the first step's forward, no optimizer) with and without
  deferred init, minus the baseline.

- `pp2xdp2_*`: an 8-layer model (~130M parameters) at pp=2 x dp=2 without and with
  `shard_optimizer_state`: per rank, the optimizer state held, the peak, and the ratio
  peak / (S + activations) with S counting the optimizer state and the gradients the
  rank really keeps (with sharding, its share of both).

One JSON line.

    PYTHONPATH=build/python .venv/bin/python bench/memory.py [--budget-gb 2.5]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from pipeline import BUILD, ActivationTracker, _python_env  # noqa: E402

VOCAB, D, LAYERS, HEADS, CTX, MB = 32000, 1024, 20, 16, 64, 4


def _status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def build(layers, vocab=VOCAB, d=D):
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).unbind(2)
            a = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(CTX, d)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.tok.weight
            for emb in (self.tok, self.pos):  # GPT-2's scale (a sane first loss)
                nn.init.normal_(emb.weight, std=0.02)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            return self.head(self.ln_f(self.blocks(x)))
    return GPT()


def rank_main(opts):
    import torch
    import torch.nn as nn
    import smp
    from smp import pipeline
    torch.set_num_threads(1)
    if opts.get("data_limit"):
        limit = int(_status_mb("VmData") * 2**20) + opts["data_limit"]
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    smp.init({"partitions": opts["partitions"], "microbatches": MB, "ddp": opts.get("ddp", False),
              "shard_optimizer_state": opts.get("shard", False)})
    with torch.device("meta"):  # torch's meta kernels (Python code): in every run
        nn.Linear(4, 4)(torch.ones(1, 4))
    start = _status_mb("VmRSS")
    t0 = time.time()
    torch.manual_seed(0)
    vocab, d = (64, 64) if opts.get("tiny") else (VOCAB, D)
    with smp.delay_param_initialization(enabled=opts["deferred"]):
        net = build(opts["layers"], vocab, d)
    total = sum(p.numel() for p in net.parameters())  # unique (the tied weight once)
    model = smp.DistributedModel(net)
    opt = None
    if opts["train"]:
        opt = smp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-4,
                                                         foreach=opts.get("foreach")))
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (MB * smp.dp_size(), CTX + 1), generator=g)
    data = data[smp.dp_rank() * MB:(smp.dp_rank() + 1) * MB]

    @smp.step
    def train(x, y):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if opts["train"]:
            model.backward(loss)
        return loss

    tracker = None
    try:
        for step in range(3 if opts["train"] else 1):
            if step == 1:
                tracker = ActivationTracker(list(model.local_parameters()))
                pipeline.Engine.task_context = tracker.context
            loss = train(data[:, :-1], data[:, 1:]).reduce_mean()
            if opt is not None:
                opt.step()
                if step < 2:  # the last step's gradients are counted below
                    opt.zero_grad()
    except MemoryError as e:
        if smp.rank() == 0:
            print("RESULT " + json.dumps({"error": str(e).splitlines()[0],
                                          "seconds": round(time.time() - t0, 1)}))
        smp.shutdown()
        return
    peak = _status_mb("VmHWM") - start
    held = sum(p.numel() for p in model.local_parameters())  # this rank's, tied once
    state = held * (4 + 4 + 8) / 2**20 if opts["train"] else held * 4 / 2**20
    if opt is not None:  # what the optimizer really holds (a share, when sharded)
        opt_mb = sum(t.numel() * t.element_size() for s in opt.state.values()
                     for t in s.values() if torch.is_tensor(t) and t.dim() > 0) / 2**20
        # The gradients it keeps: all, or with sharding its share (Note [Reduce to owner]).
        grads = sum(p.grad.numel() for p in model.local_parameters() if p.grad is not None)
        state = (held + grads) * 4 / 2**20 + opt_mb
    act = tracker.peak / 2**20 if tracker is not None else 0.0
    rows = smp.allgather(dict(peak_mb=round(peak, 1), state_mb=round(state, 1),
                              optimizer_mb=round(opt_mb, 1) if opt is not None else 0.0,
                              activation_mb=round(act, 1), params=held))
    if smp.rank() == 0:
        print("RESULT " + json.dumps({"ranks": rows, "loss": loss.item(), "total": total,
                                      "seconds": round(time.time() - t0, 1)}))
    smp.shutdown()


def launch(**opts):
    cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", str(opts["world"]),
           __file__, "--role", "rank", "--opts", json.dumps(opts)]
    out = subprocess.run(cmd, env=_python_env(), capture_output=True, text=True, timeout=1800)
    line = [ln for ln in out.stdout.splitlines() if "RESULT " in ln]
    if not line:
        sys.exit(f"run {opts} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[0].split("RESULT ", 1)[1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="main")
    p.add_argument("--opts", default="{}")
    p.add_argument("--budget-gb", type=float, default=3.0)
    args = p.parse_args()
    if args.role == "rank":
        return rank_main(json.loads(args.opts))
    budget = int(args.budget_gb * 2**30)
    base = dict(world=4, partitions=4, deferred=True, train=True, layers=LAYERS)
    # The baseline: the same job with a tiny model (width 64, vocabulary 64): code,
    # threads, buffers; what every rank holds whatever the model.
    floor = [r["peak_mb"] for r in launch(**dict(base, tiny=True))["ranks"]]
    pp4 = launch(**dict(base, data_limit=budget))
    pp4_loop = launch(**dict(base, data_limit=budget, foreach=False))
    pp1 = launch(**dict(base, world=1, partitions=1, data_limit=budget))
    wrap_d = launch(**dict(base, train=False))["ranks"]
    # pp=2 x dp=2, 8 layers (~130M parameters), without and with optimizer-state sharding.
    dp = dict(base, partitions=2, layers=8, ddp=True)
    unsharded, sharded = launch(**dp)["ranks"], launch(**dict(dp, shard=True))["ranks"]
    wrap_e = launch(**dict(base, train=False, deferred=False))["ranks"]
    one_process_gb = pp4["total"] * 16 / 1e9

    def rows_of(run):
        rows = []
        for r, f in zip(run["ranks"], floor):
            peak = r["peak_mb"] - f
            rows.append(dict(peak_mb=round(peak, 1), state_mb=r["state_mb"],
                             activation_mb=r["activation_mb"],
                             ratio=round(peak / (r["state_mb"] + r["activation_mb"]), 3)))
        return rows
    rows, loop_rows = rows_of(pp4), rows_of(pp4_loop)
    import torch
    out = {"bench": "memory", "model_params_m": round(pp4["total"] / 1e6, 1),
           "one_process_state_gb": round(one_process_gb, 2), "budget_gb": args.budget_gb,
           "floor_mb": floor, "pp4_ranks": rows, "ratio_max": max(r["ratio"] for r in rows),
           "ratio_max_foreach_off": max(r["ratio"] for r in loop_rows),
           "pp4_seconds": pp4["seconds"], "pp4_loss": pp4.get("loss"),
           "pp1_error": pp1.get("error"), "pp1_seconds": pp1.get("seconds"),
           "wrap_deferred_mb": [round(r["peak_mb"] - f, 1) for r, f in zip(wrap_d, floor)],
           "wrap_eager_mb": [round(r["peak_mb"] - f, 1) for r, f in zip(wrap_e, floor)],
           "pp2xdp2_optimizer_mb": [r["optimizer_mb"] for r in unsharded],
           "pp2xdp2_sharded_optimizer_mb": [r["optimizer_mb"] for r in sharded],
           "pp2xdp2_peak_mb": [round(r["peak_mb"] - f, 1) for r, f in zip(unsharded, floor)],
           "pp2xdp2_sharded_peak_mb": [round(r["peak_mb"] - f, 1) for r, f in zip(sharded, floor)],
           "pp2xdp2_sharded_ratio": [round((r["peak_mb"] - f) / (r["state_mb"] + r["activation_mb"]), 3)
                                     for r, f in zip(sharded, floor)],
           "torch": torch.__version__}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
