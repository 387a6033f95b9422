"""PowerSGD benchmark: smp's C++ powerSGD_hook against torch DDP (plain allreduce) and
torch DDP + torch's own powerSGD_hook, in the same run.

2 ranks (Gloo, loopback), torch.set_num_threads(1) each, 6x (Linear(1024,1024)+ReLU),
batch 64 per rank, SGD, matrix_approximation_rank 2, compression from step 2. torch's
PowerSGD gets one bucket (with two or more it aborts on Gloo, FACTS.md); smp keeps its
default buckets. All three models start equal and see the same data; blocks of steps
are timed in turn so drift of the machine hits all alike. Checked: smp's replicas are
identical, bytes sent per step are counted by the hook. Prints one JSON line
(ratio = smp PowerSGD / torch DDP allreduce).

`--probe-many-buckets N`: also runs torch's powerSGD_hook alone with bucket_cap_mb=4
(6+ buckets) N times, 30 steps each, and reports how many runs survived on Gloo and the
first failure's text (torch 1.13 and 2.15 abort with gloo::EnforceNotMet or hang: its
chained P/Q allreduces are issued from future callbacks, in a different order on each
rank; FACTS.md). Only where it survives would a many-bucket timing mean anything.

    PYTHONPATH=build/python .venv/bin/python bench/powersgd.py [--rounds 5] [--steps 10]
        [--bucket-view] [--bucket-cap-mb 25] [--probe-many-buckets 3]
"""
import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import _malloc  # bench/_malloc.py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BUILD = os.environ.get("SMP_BUILD_DIR", os.path.join(REPO, "build"))
RANK_R = 2


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import smp
    from smp.ddp_comm_hooks import powerSGD_hook as smp_psgd
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as th_psgd
    torch.set_num_threads(1)
    smp.init({"ddp": True})
    pg = smp.get_dp_process_group()
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    base = nn.Sequential(*layers)
    kw = dict(matrix_approximation_rank=RANK_R, start_powerSGD_iter=2, random_seed=0)

    plain_net = copy.deepcopy(base)
    view = args.bucket_view  # the same for all three models
    plain = nn.parallel.DistributedDataParallel(plain_net, process_group=pg,
                                                gradient_as_bucket_view=view)
    plain_opt = torch.optim.SGD(plain_net.parameters(), lr=1e-3)

    th_net = copy.deepcopy(base)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES
    dist._DEFAULT_FIRST_BUCKET_BYTES = 64 << 20  # one bucket (DDP's documented knob)
    th = nn.parallel.DistributedDataParallel(th_net, process_group=pg, bucket_cap_mb=64,
                                             gradient_as_bucket_view=view)
    dist._DEFAULT_FIRST_BUCKET_BYTES = first
    th.register_comm_hook(th_psgd.PowerSGDState(process_group=pg, **kw), th_psgd.powerSGD_hook)
    th_opt = torch.optim.SGD(th_net.parameters(), lr=1e-3)

    model = smp.DistributedModel(base, gradient_as_bucket_view=view,
                                 bucket_cap_mb=args.bucket_cap_mb)
    opt = smp.DistributedOptimizer(torch.optim.SGD(base.parameters(), lr=1e-3))
    state = smp_psgd.PowerSGDState(None, **kw)
    model.register_comm_hook(state, smp_psgd.powerSGD_hook)

    @smp.step
    def train(x):
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    gen = torch.Generator().manual_seed(smp.rank())
    batches = [torch.randn(64, 1024, generator=gen) for _ in range(4)]

    def smp_step(i):
        train(batches[i % 4])
        opt.step()
        opt.zero_grad()

    def ddp_step(ddp, o):
        def step(i):
            ddp(batches[i % 4]).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        return step

    plain_step, th_step = ddp_step(plain, plain_opt), ddp_step(th, th_opt)

    def timed(fn, n):
        smp.barrier()
        start = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - start) / n * 1e3

    for i in range(4):  # warm up; compression starts at step 2
        smp_step(i)
        plain_step(i)
        th_step(i)
    assert state.iter >= state.start_powerSGD_iter
    smp_t, plain_t, th_t = [], [], []
    bytes0 = state.bytes_allreduced()
    for _ in range(args.rounds):
        plain_t.append(timed(plain_step, args.steps))
        th_t.append(timed(th_step, args.steps))
        smp_t.append(timed(smp_step, args.steps))
    smp_bytes = (state.bytes_allreduced() - bytes0) / (args.rounds * args.steps)
    plain_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    replicas = smp.allgather(flat, smp.CommGroup.DP_GROUP)
    assert all(torch.equal(replicas[0], t) for t in replicas), "smp replicas differ"
    assert torch.isfinite(flat).all()
    times = smp.allgather((statistics.median(smp_t), statistics.median(plain_t),
                           statistics.median(th_t)))
    if smp.rank() == 0:
        smp_ms, plain_ms, th_ms = (max(t[k] for t in times) for k in range(3))
        print("RESULT " + json.dumps({
            "bench": "powersgd", "world": smp.size(), "rank": RANK_R,
            "bucket_view": args.bucket_view, "smp_ms": round(smp_ms, 2),
            "torch_ms": round(plain_ms, 2), "torch_powersgd_ms": round(th_ms, 2),
            "ratio": round(smp_ms / plain_ms, 3),
            "ratio_vs_torch_powersgd": round(smp_ms / th_ms, 3),
            "smp_bytes_per_step": int(smp_bytes), "allreduce_bytes_per_step": plain_bytes,
            "bytes_reduction": round(plain_bytes / smp_bytes, 1),
            "smp_buckets": len(model._reducer.bucket_indices()),
            "smp_bucket_cap_mb": args.bucket_cap_mb,
            "torch": torch.__version__}))


def probe_worker():
    """torch DDP + torch's powerSGD_hook with many buckets, nothing of smp's."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as th_psgd
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    net = nn.Sequential(*layers)
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=4)
    ddp.register_comm_hook(th_psgd.PowerSGDState(process_group=None,
                                                 matrix_approximation_rank=RANK_R,
                                                 start_powerSGD_iter=2, random_seed=0),
                           th_psgd.powerSGD_hook)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(30):
        ddp(torch.randn(64, 1024, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
        print("RESULT " + json.dumps({"buckets": len(str(sizes).split(","))}))


def probe_many_buckets(runs, env):
    """Runs probe_worker `runs` times (60 s each at most): how many survived, and how
    the others failed (error text -> count)."""
    passed, failures, buckets = 0, {}, None
    for _ in range(runs):
        cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", "2", __file__,
               "--probe-worker"]
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            why = "hung: not finished within 60 s (killed)"
        else:
            line = [ln for ln in out.stdout.splitlines() if "RESULT " in ln]
            if out.returncode == 0 and line:
                passed += 1
                buckets = json.loads(line[0].split("RESULT ", 1)[1])["buckets"]
                continue
            what = [ln for ln in out.stderr.splitlines() if "what()" in ln or "Error" in ln]
            why = (what[0].split("] ", 1)[-1] if what else out.stderr[-300:]).strip()[:300]
        failures[why] = failures.get(why, 0) + 1
    res = {"runs": runs, "passed": passed, "bucket_cap_mb": 4}
    if buckets:
        res["buckets"] = buckets
    if failures:
        res["failures"] = failures
    return res


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bucket-view", action="store_true",
                        help="every model with gradient_as_bucket_view=True")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="smp's bucket_cap_mb (torch PowerSGD keeps one bucket)")
    parser.add_argument("--probe-many-buckets", type=int, default=0, metavar="RUNS",
                        help="also try torch's powerSGD_hook with many buckets RUNS times")
    parser.add_argument("--probe-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "RANK" in os.environ:
        return probe_worker() if args.probe_worker else worker(args)
    # Note [Fixed mmap threshold] (smp_core/runtime.h): smp's default, on both sides.
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               **_malloc.SMP_DEFAULT,
               SMP_PYTHON=sys.executable)
    cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", "2", __file__,
           "--rounds", str(args.rounds), "--steps", str(args.steps)]
    if args.bucket_view:
        cmd.append("--bucket-view")
    cmd += ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in out.stdout.splitlines() if "RESULT " in ln]
    if out.returncode or not line:
        sys.exit(f"powersgd bench failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    res = json.loads(line[0].split("RESULT ", 1)[1])
    if args.probe_many_buckets:
        res["torch_powersgd_many_buckets"] = probe_many_buckets(args.probe_many_buckets, env)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
