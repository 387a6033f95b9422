"""bench/mixed_precision.py's pipeline section: the pp=2 step in bf16 against fp32, and
smp's fp16 pipeline step against the same model trained plainly in one process under the
same settings (fp16 weights, fp32 master weights, a dynamic loss scale, the same batch).

Model: 8 x (Linear(768, 768) + GELU) + Linear(768, 768), batch 64 rows, 8 microbatches
at pp=2, AdamW. Each pp rank runs one thread (smprun's ranks, bench/pipeline.py's
setting); the one-process peer runs with 1 and with 2 threads and the better one counts
(the best a user could pick on this machine). Steps alternate between the sides within
one run; each figure is the median of its timed steps after warm-up steps.

    PYTHONPATH=build/python .venv/bin/python bench/_mp_pipeline.py  (one JSON line)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import _malloc  # bench/_malloc.py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUILD = os.environ.get("SMP_BUILD_DIR", os.path.join(ROOT, "build"))
PYTHON = sys.executable
WIDTH, DEPTH, ROWS, MB = 768, 8, 64, 8


def _net(torch):
    nn = torch.nn
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, WIDTH))


def _data(torch, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def role_rank(args):
    """One pp rank under smprun: `steps` timed steps after 3 warm-up steps."""
    import torch
    import smp
    torch.set_num_threads(1)
    cfg = {"partitions": 2, "microbatches": MB}
    if args.dtype != "fp32":
        cfg[args.dtype] = True
    smp.init(cfg)
    torch.manual_seed(0)
    model = smp.DistributedModel(_net(torch))
    kw = dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 1024.0}) \
        if args.dtype == "fp16" else {}
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), **kw)

    @smp.step
    def train_step(x, y):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        model.backward(loss)
        return loss

    times = []
    for step in range(3 + args.steps):
        x, y = _data(torch, step)
        smp.barrier()
        t0 = time.perf_counter()
        train_step(x, y)
        opt.step()
        opt.zero_grad()
        if step >= 3:
            times.append(time.perf_counter() - t0)
    if smp.rank() == 0:
        print("RESULT " + json.dumps({"ms": statistics.median(times) * 1e3}), flush=True)
    smp.shutdown()


def role_plain(args):
    """The same model in one process, on the whole batch, under the rules smp runs:
    fp16 (weights in fp16, fp32 masters, a dynamic loss scale), bf16 (fp32 masters) or
    fp32."""
    import torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    net = _net(torch).to(dtype)
    params = list(net.parameters())
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    if dtype == torch.float32:
        masters = params
    opt = torch.optim.AdamW(masters, lr=1e-4)
    scale = 1024.0 if dtype == torch.float16 else 1.0
    times = []
    for step in range(3 + args.steps):
        x, y = _data(torch, step)
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(net(x.to(dtype)).float(), y)
        (loss * scale).backward()
        if all(torch.isfinite(p.grad).all() for p in params):
            if masters is not params:
                for p, m in zip(params, masters):
                    m.grad = p.grad.float().mul_(1.0 / scale)
            opt.step()
            if masters is not params:
                with torch.no_grad():
                    for p, m in zip(params, masters):
                        p.copy_(m)
        else:
            scale /= 2
        net.zero_grad()
        for m in masters:
            m.grad = None
        if step >= 3:
            times.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps({"ms": statistics.median(times) * 1e3}), flush=True)


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.update(_malloc.SMP_DEFAULT)
    env["PYTHONPATH"] = os.path.join(BUILD, "python") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _result(cmd, env):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[") else line
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])["ms"]
    raise RuntimeError(f"{cmd} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def _pp(dtype, steps):
    cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", "2", __file__,
           "--role", "rank", "--dtype", dtype, "--steps", str(steps)]
    return _result(cmd, _env())


def _plain(threads, steps, dtype="fp16"):
    env = dict(_env(), OMP_NUM_THREADS=str(threads))
    return _result([PYTHON, __file__, "--role", "plain", "--threads", str(threads),
                    "--dtype", dtype, "--steps", str(steps)], env)


def bench_pipeline(rounds=2, steps=10):
    """{pp2_fp32_ms, pp2_bf16_ms, pp2_fp16_ms, plain_fp16_ms, bf16_over_fp32,
    fp16_pp2_over_plain, ...}: medians over `rounds` alternating rounds. The plain
    one-process bf16/fp32 steps (1 thread) tell what this CPU's kernels cost in bf16,
    apart from the pipeline."""
    runs = {k: [] for k in ("fp32", "bf16", "fp16", "plain1", "plain2", "plain_fp32",
                            "plain_bf16")}
    for _ in range(rounds):
        for dtype in ("fp32", "bf16", "fp16"):
            runs[dtype].append(_pp(dtype, steps))
        runs["plain1"].append(_plain(1, steps))
        runs["plain2"].append(_plain(2, steps))
        runs["plain_fp32"].append(_plain(1, steps, "fp32"))
        runs["plain_bf16"].append(_plain(1, steps, "bf16"))
    med = {k: statistics.median(v) for k, v in runs.items()}
    plain = min(med["plain1"], med["plain2"])
    return {"pp2_fp32_ms": round(med["fp32"], 2), "pp2_bf16_ms": round(med["bf16"], 2),
            "pp2_fp16_ms": round(med["fp16"], 2), "plain_fp16_ms": round(plain, 2),
            "plain_fp16_threads": 1 if med["plain1"] <= med["plain2"] else 2,
            "bf16_over_fp32": round(med["bf16"] / med["fp32"], 3),
            "fp16_pp2_over_plain": round(med["fp16"] / plain, 3),
            "plain_1thread_fp32_ms": round(med["plain_fp32"], 2),
            "plain_1thread_bf16_ms": round(med["plain_bf16"], 2),
            "plain_bf16_over_fp32": round(med["plain_bf16"] / med["plain_fp32"], 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="main")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.role == "rank":
        return role_rank(args)
    if args.role == "plain":
        return role_plain(args)
    print(json.dumps(dict(bench="mixed_precision_pipeline", **bench_pipeline(args.rounds,
                                                                              args.steps))))


if __name__ == "__main__":
    main()
