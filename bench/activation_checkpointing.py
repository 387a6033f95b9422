"""Activation checkpointing benchmark: what smp.set_activation_checkpointing saves and
what it costs, against torch.utils.checkpoint on the same model in one process.

Model: 8 blocks of (Linear(512,512) + GELU) x 2 and a head, batch 1024, one thread per
rank. smp runs pp=2 with 8 microbatches ("interleaved"), each block checkpointed
(strategy "each" on the top nn.Sequential) or not; the peer is the plain model in one
process on the same 8 microbatches one after the other (gradient accumulation: the work
the pipeline divides between its ranks, with as many checkpointed calls), each block
under torch.utils.checkpoint (non-reentrant) or not. Runs
alternate, the same threads, allocator and data on every side. One JSON line:
- `smp_ms` / `smp_ckpt_ms` and `smp_cost` (their ratio), `torch_ms` / `torch_ckpt_ms`
  and `torch_cost`; `ratio` = smp_cost / torch_cost (what checkpointing costs smp over
  what it costs torch);
- `saved_mb` / `saved_ckpt_mb`: per pp rank, the peak bytes held for backward outside
  checkpointed regions (saved-tensor hooks; the recomputation's own working set, one
  block at a time, is not in it), and the same for the peer;
- `rss_growth_mb` / `rss_growth_ckpt_mb`: per rank, the peak resident set over training
  minus the resident set before the first step (allocator noise included).

    PYTHONPATH=build/python .venv/bin/python bench/activation_checkpointing.py [--rounds 2] [--steps 8]
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from pipeline import BUILD, PYTHON, ActivationTracker, _python_env, smp_training  # noqa: E402

S, M, BATCH, WIDTH, DEPTH = 2, 8, 1024, 512, 8


def build_model():
    import torch.nn as nn
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU())
              for _ in range(DEPTH)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 10))


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_pp(steps, ckpt):
    import smp
    from smp import pipeline
    _, model, opt, train, x, y = smp_training(build_model, BATCH, WIDTH, ckpt=ckpt)
    rss0 = _rss_mb()
    for _ in range(2):
        train(x, y)
        opt.step()
        opt.zero_grad()
    start = time.perf_counter()
    for _ in range(steps):
        train(x, y)
        opt.step()
        opt.zero_grad()
    ms = (time.perf_counter() - start) / steps * 1e3
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
    tracker = ActivationTracker(list(model.local_parameters()))
    pipeline.Engine.task_context = tracker.context
    train(x, y)
    saved = smp.allgather(round(tracker.peak / 2**20, 2))
    growth = smp.allgather(round(growth, 1))
    if smp.rank() == 0:
        print("RESULT " + json.dumps({"ms": ms, "saved_mb": saved, "rss_growth_mb": growth}))


def run_single(steps, ckpt):
    import torch
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = build_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))

    def forward(x):
        for m in net:
            x = checkpoint(m, x, use_reentrant=False) if ckpt and m is not net[-1] else m(x)
        return x

    def step():
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            loss = nn.functional.cross_entropy(forward(xm), ym) / M
            loss.backward()
        opt.step()
        opt.zero_grad()

    rss0 = _rss_mb()
    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - start) / steps * 1e3
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
    tracker = ActivationTracker(list(net.parameters()))
    with tracker.context():
        step()
    print("RESULT " + json.dumps({"ms": ms, "saved_mb": [round(tracker.peak / 2**20, 2)],
                                  "rss_growth_mb": [round(growth, 1)]}))


def launch(role, steps, ckpt):
    args = [__file__, "--role", role, "--steps", str(steps)] + (["--ckpt"] if ckpt else [])
    if role == "pp":
        cfg = {"partitions": S, "microbatches": M}
        cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", str(S), "--config",
               json.dumps(cfg)] + args
    else:
        cmd = [PYTHON] + args
    out = subprocess.run(cmd, env=_python_env(), capture_output=True, text=True, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if "RESULT " in ln]
    if out.returncode or not line:
        sys.exit(f"{role} run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[0].split("RESULT ", 1)[1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="main")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ckpt", action="store_true")
    args = p.parse_args()
    if args.role == "pp":
        return run_pp(args.steps, args.ckpt)
    if args.role == "single":
        return run_single(args.steps, args.ckpt)
    runs = {}
    for _ in range(args.rounds):  # alternate every side, round by round
        for role in ("pp", "single"):
            for ckpt in (False, True):
                runs.setdefault((role, ckpt), []).append(launch(role, args.steps, ckpt))

    def ms(role, ckpt):
        return statistics.median(r["ms"] for r in runs[(role, ckpt)])

    def last(role, ckpt, key):
        return runs[(role, ckpt)][-1][key]
    out = {"bench": "activation_checkpointing", "pp": S, "microbatches": M, "batch": BATCH,
           "smp_ms": round(ms("pp", False), 1), "smp_ckpt_ms": round(ms("pp", True), 1),
           "torch_ms": round(ms("single", False), 1),
           "torch_ckpt_ms": round(ms("single", True), 1)}
    out["smp_cost"] = round(out["smp_ckpt_ms"] / out["smp_ms"], 3)
    out["torch_cost"] = round(out["torch_ckpt_ms"] / out["torch_ms"], 3)
    out["ratio"] = round(out["smp_cost"] / out["torch_cost"], 3)
    for key in ("saved_mb", "rss_growth_mb"):
        out[key] = last("pp", False, key)
        out[key.replace("_mb", "_ckpt_mb")] = last("pp", True, key)
        out["torch_" + key] = last("single", False, key)
        out["torch_" + key.replace("_mb", "_ckpt_mb")] = last("single", True, key)
    import torch
    out["torch"] = torch.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
