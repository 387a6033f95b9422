"""Checkpoint benchmark: smp.save/smp.load (partial) against torch.save/torch.load of
the same tensors, in the same run.

2 ranks at pp=2 (Gloo, loopback), a ~200 MB model (48 x Linear(1024, 1024)), so each
rank saves and loads its ~100 MB part. smp's save includes sealing (XXH3 of the file,
manifest), fsync of the file, the rename and fsync of the directory; its load reads and
verifies every byte before unpickling. torch's save gets the same fsync (file and
directory), so both pay for the disk alike; torch's save without fsync is reported too.
Rounds alternate which of smp and torch goes first; medians, the slower rank counts. One JSON line.

    PYTHONPATH=build/python /usr/bin/python3 bench/checkpoint.py [--rounds 5] [--dir DIR]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BUILD = os.environ.get("SMP_BUILD_DIR", os.path.join(REPO, "build"))


def worker(args):
    import torch
    import torch.nn as nn
    import smp
    torch.set_num_threads(1)
    smp.init({"partitions": 2, "microbatches": 1})
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(48)])
    model = smp.DistributedModel(net)

    @smp.step
    def fwd(x):
        return model(x)

    fwd(torch.randn(1, 1024))  # partitions the model
    sd = model.local_state_dict()
    mb = sum(v.numel() * v.element_size() for v in sd.values() if torch.is_tensor(v)) / 2**20
    smp_f = os.path.join(args.dir, "smp.pt")
    torch_f = os.path.join(args.dir, f"torch.pt_{smp.pp_rank()}")

    def fsync_dir(path):
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def smp_save():
        smp.save(sd, smp_f, partial=True)

    def torch_save():
        with open(torch_f, "wb") as fh:
            torch.save(sd, fh)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(torch_f)

    def torch_save_nosync():
        torch.save(sd, torch_f)

    def timed(fn):
        smp.barrier()
        t = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t) * 1e3, out

    def check(got):
        for k, v in sd.items():
            if torch.is_tensor(v):
                assert torch.equal(got[k], v), k

    # Each result is dropped before the next load (neither side gets the other's freed
    # memory), the order alternates, and nothing leaves dirty pages behind for the
    # other side's fsync to flush (the unsynced torch.save runs last, once).
    times = {k: [] for k in ("smp_save", "torch_save", "smp_load", "torch_load")}
    for r in range(args.rounds + 1):  # round 0 warms up
        res = {}
        order = ["smp", "torch"] if r % 2 else ["torch", "smp"]
        for who in order:
            res[f"{who}_save"] = timed(smp_save if who == "smp" else torch_save)[0]
        for who in order:
            ms, got = timed((lambda: smp.load(smp_f, partial=True)) if who == "smp"
                            else (lambda: torch.load(torch_f)))
            check(got)
            del got
            res[f"{who}_load"] = ms
        if r:
            for k, v in res.items():
                times[k].append(v)
    times["torch_save_nosync"] = [timed(torch_save_nosync)[0]]
    med = {k: statistics.median(v) for k, v in times.items()}
    allm = smp.allgather(med)
    if smp.rank() == 0:
        worst = {k: max(m[k] for m in allm) for k in med}
        print("RESULT " + json.dumps({
            "bench": "checkpoint", "world": smp.size(), "pp": 2,
            "mb_per_rank": round(mb, 1),
            "smp_save_ms": round(worst["smp_save"], 1),
            "torch_save_fsync_ms": round(worst["torch_save"], 1),
            "torch_save_nofsync_ms": round(worst["torch_save_nosync"], 1),
            "save_ratio": round(worst["smp_save"] / worst["torch_save"], 3),
            "smp_load_ms": round(worst["smp_load"], 1),
            "torch_load_ms": round(worst["torch_load"], 1),
            "load_ratio": round(worst["smp_load"] / worst["torch_load"], 3),
            "torch": torch.__version__}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    with tempfile.TemporaryDirectory(dir=args.dir or None, prefix="smp_bench_ckpt_") as d:
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", "2", __file__,
               "--rounds", str(args.rounds), "--dir", d]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in out.stdout.splitlines() if "RESULT " in ln]
    if out.returncode or not line:
        sys.exit(f"checkpoint bench failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    print(line[0].split("RESULT ", 1)[1])


if __name__ == "__main__":
    main()
