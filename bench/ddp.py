"""Data-parallel benchmark: smp's reducer against torch DDP in the same run.

2 ranks (Gloo, loopback), torch.set_num_threads(1) each, 6x (Linear(1024,1024)+ReLU),
batch 64 per rank, SGD. Both models start equal and see the same data; blocks of steps
of each are timed alternately so drift of the machine hits both alike, and their
parameters must still agree at the end. Prints one JSON line (ratio = smp / torch).

    PYTHONPATH=build/python .venv/bin/python bench/ddp.py [--rounds 5] [--steps 10]
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


def worker(args):
    import torch
    import torch.nn as nn
    import smp
    torch.set_num_threads(1)
    smp.init({"ddp": True})
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    base = nn.Sequential(*layers)
    ref = copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(ref, process_group=smp.get_dp_process_group(),
                                              bucket_cap_mb=args.torch_bucket_cap_mb)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    model = smp.DistributedModel(base)
    opt = smp.DistributedOptimizer(torch.optim.SGD(base.parameters(), lr=1e-3))

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

    def torch_step(i):
        ddp(batches[i % 4]).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()

    def timed(fn, n):
        smp.barrier()
        start = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - start) / n * 1e3

    for i in range(3):  # warm up (smp: broadcast, buckets, rebuild)
        smp_step(i)
        torch_step(i)
    smp_times, torch_times = [], []
    for _ in range(args.rounds):
        torch_times.append(timed(torch_step, args.steps))
        smp_times.append(timed(smp_step, args.steps))
    # Both trained on the same batches for the same number of steps: still equal.
    for (name, p), q in zip(base.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    stats = model._reducer.stats()
    log = ddp._get_ddp_logging_data()  # after the rebuild, the buckets in use
    sizes = log.get("rebuilt_bucket_sizes") or log.get("bucket_sizes", "")
    torch_buckets = str(sizes).count(",") + 1
    times = smp.allgather((statistics.median(smp_times), statistics.median(torch_times)))
    if smp.rank() == 0:
        smp_ms = max(t[0] for t in times)
        torch_ms = max(t[1] for t in times)
        print("RESULT " + json.dumps({
            "bench": "ddp", "world": smp.size(), "smp_ms": round(smp_ms, 2),
            "torch_ms": round(torch_ms, 2), "ratio": round(smp_ms / torch_ms, 3),
            "buckets": stats["buckets"], "torch_buckets": torch_buckets,
            "torch_bucket_cap_mb": args.torch_bucket_cap_mb, "smp_comm_ms": round(stats["comm_ms"], 2),
            "smp_wait_ms": round(stats["wait_ms"], 2), "smp_copy_in_ms": round(stats["copy_in_ms"], 2),
            "torch": torch.__version__}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--torch-bucket-cap-mb", type=float, default=25.0,
                        help="torch DDP's bucket_cap_mb (its default 25 gives this model "
                             "one bucket after the rebuild: no overlap)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    # Note [Fixed mmap threshold] (smp_core/runtime.h): smp's default, on both sides.
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               **_malloc.SMP_DEFAULT,
               SMP_PYTHON=sys.executable)  # the ranks run on this interpreter's torch
    cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", "2", __file__,
           "--rounds", str(args.rounds), "--steps", str(args.steps),
           "--torch-bucket-cap-mb", str(args.torch_bucket_cap_mb)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in out.stdout.splitlines() if "RESULT " in ln]
    if out.returncode or not line:
        sys.exit(f"ddp bench failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    print(line[0].split("RESULT ", 1)[1])


if __name__ == "__main__":
    main()
