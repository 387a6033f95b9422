"""Data parallelism across hosts: dp=4 over 2 hosts x 2 ranks on the namespace harness
(tests/hosts/netns.py: network namespaces, a bridge, links shaped with tc tbf).

- "ddp": links at 1 Gbit/s; smp's step (hierarchical reduction, Note [Hierarchical
  reduction] in smp_core/detail/host_links.cpp) against torch DDP over Gloo on the
  same dp group, in the same processes, blocks of steps timed alternately (as
  bench/ddp.py), parameters equal at the end. Target ratio <= 0.7.
- "powersgd": links at 100 Mbit/s; smp with PowerSGD (matrix rank 1 and 4) against
  smp's own allreduce, one job each. Target ratio <= 0.4.
Each reports the bytes host 0 sent per step (its eth0's tx_bytes).

Both cases: host 1's link holds every frame --delay ms (0.5) each way, so the hosts are
0.5 ms apart one way, 1 ms round trip (tests/hosts/linkdelay.cpp: this kernel has no
tc netem).

Root only (namespaces); elsewhere it prints {"bench": "hosts", "skipped": why}.

    sudo PYTHONPATH=build/python .venv/bin/python bench/hosts.py [--rounds 4] [--steps 5]
"""
import argparse
import copy
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

import _malloc  # bench/_malloc.py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BUILD = os.path.abspath(os.environ.get("SMP_BUILD_DIR", os.path.join(REPO, "build")))
sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))
import netns  # noqa: E402  (tests/hosts/netns.py)


def _tx_bytes():
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:  # this host's namespace
        return int(f.read())


def worker(args):
    import torch
    import torch.nn as nn
    import smp
    torch.set_num_threads(1)
    smp.init({"ddp": True})
    torch.manual_seed(0)
    width = args.width
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(width, width), nn.ReLU()]
    base = nn.Sequential(*layers)
    ref = copy.deepcopy(base)
    model = smp.DistributedModel(base)
    opt = smp.DistributedOptimizer(torch.optim.SGD(base.parameters(), lr=1e-3))
    if args.hook:
        from smp.ddp_comm_hooks import powerSGD_hook as psgd
        model.register_comm_hook(psgd.PowerSGDState(None, matrix_approximation_rank=args.hook,
                                                    start_powerSGD_iter=2),
                                 psgd.powerSGD_hook)
    ddp = None
    if args.peer:
        ddp = nn.parallel.DistributedDataParallel(ref, process_group=smp.get_dp_process_group())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)

    @smp.step
    def train(x):
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    gen = torch.Generator().manual_seed(smp.rank())
    batches = [torch.randn(args.batch, width, generator=gen) for _ in range(4)]

    def smp_step(i):
        train(batches[i % 4])
        opt.step()
        opt.zero_grad()

    def torch_step(i):
        ddp(batches[i % 4]).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()

    sent = {"smp": [], "torch": []}

    def timed(name, fn, n):
        smp.barrier()
        tx, start = _tx_bytes(), time.perf_counter()
        for i in range(n):
            fn(i)
        ms = (time.perf_counter() - start) / n * 1e3
        smp.barrier()
        sent[name].append((_tx_bytes() - tx) / n)
        return ms

    for i in range(3):  # warm up: broadcast, buckets, rebuild, PowerSGD's start
        smp_step(i)
        if ddp is not None:
            torch_step(i)
    smp_times, torch_times = [], []
    for _ in range(args.rounds):
        if ddp is not None:
            torch_times.append(timed("torch", torch_step, args.steps))
        smp_times.append(timed("smp", smp_step, args.steps))
    if ddp is not None:  # the same batches, the same steps: still equal
        for (name, p), q in zip(base.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    times = smp.allgather((statistics.median(smp_times),
                           statistics.median(torch_times) if torch_times else 0.0))
    if smp.rank() == 0:
        print("RESULT " + json.dumps({
            "smp_ms": max(t[0] for t in times), "torch_ms": max(t[1] for t in times),
            "smp_bytes": statistics.median(sent["smp"]),
            "torch_bytes": statistics.median(sent["torch"]) if sent["torch"] else 0,
            "hierarchy": model._reducer.hierarchy() != "",
            "stats": {k: v for k, v in model._reducer.stats().items() if k.endswith("_ms")},
            "params": sum(p.numel() for p in base.parameters())}), flush=True)


def job(hosts, tmp, argv, timeout=900):
    """One smprun per host (2 ranks each) running this file as the worker; its RESULT."""
    secret = os.path.join(tmp, "secret")
    with open(secret, "w") as f:
        f.write(secrets.token_hex(32))
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0", SMP_PYTHON=sys.executable,
               **_malloc.SMP_DEFAULT)
    procs = [hosts.popen(i, [os.path.join(BUILD, "bin", "smprun"), "--nnodes", 2,
                             "--node_rank", i, "--nproc_per_node", 2,
                             "--master_addr", hosts.addr(0), "--master_port", 29500,
                             "--secret_file", secret, __file__, *argv],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    line = [ln for ln in outs[0].splitlines() if "RESULT " in ln]
    if any(p.returncode for p in procs) or not line:
        sys.exit("hosts bench failed:\n" + "\n".join(o[-3000:] for o in outs))
    return json.loads(line[0].split("RESULT ", 1)[1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hook", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8,
                        help="rows per rank and step (small: the link, not the two cores "
                             "shared by four ranks, dominates the step)")
    parser.add_argument("--only", choices=["ddp", "powersgd"])
    parser.add_argument("--peer", action="store_true")
    parser.add_argument("--rate", type=int, default=1000, help="Mbit/s of the ddp case")
    parser.add_argument("--delay", type=float, default=0.5,
                        help="ms host 1's link holds each frame, each way")
    args = parser.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    ok, why = netns.available()
    if not ok:
        print(json.dumps({"bench": "hosts", "skipped": why}))
        return
    common = ["--rounds", str(args.rounds), "--steps", str(args.steps),
              "--batch", str(args.batch)]
    out = {"bench": "hosts", "world": 4, "hosts": 2, "delay_ms": args.delay}
    with tempfile.TemporaryDirectory() as tmp, netns.Hosts(2) as hosts:
        for i in range(2):
            hosts.shape(i, rate_mbit=args.rate, delay_ms=args.delay if i == 1 else None)
        r = None if args.only == "powersgd" else job(hosts, tmp, common + ["--peer", "--width", str(args.width),
                                      "--layers", str(args.layers)])
        out["ddp"] = r and {"link_mbit": args.rate, "smp_stats": r["stats"], "params": r["params"], "hierarchical": r["hierarchy"],
                      "smp_ms": round(r["smp_ms"], 1), "torch_ms": round(r["torch_ms"], 1),
                      "ratio": round(r["smp_ms"] / r["torch_ms"], 3),
                      "smp_host_bytes_per_step": int(r["smp_bytes"]),
                      "torch_host_bytes_per_step": int(r["torch_bytes"])}
        if args.only == "ddp":
            print(json.dumps(out))
            return
        for i in range(2):
            hosts.shape(i, rate_mbit=100)
        small = common + ["--width", "512", "--layers", str(args.layers)]
        base = job(hosts, tmp, small)
        out["powersgd"] = {"link_mbit": 100, "params": base["params"],
                           "allreduce_ms": round(base["smp_ms"], 1),
                           "allreduce_host_bytes_per_step": int(base["smp_bytes"])}
        for rank in (1, 4):
            r = job(hosts, tmp, small + ["--hook", str(rank)])
            out["powersgd"][f"rank{rank}_ms"] = round(r["smp_ms"], 1)
            out["powersgd"][f"rank{rank}_ratio"] = round(r["smp_ms"] / base["smp_ms"], 3)
            out["powersgd"][f"rank{rank}_host_bytes_per_step"] = int(r["smp_bytes"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
