"""Checkpoint benchmark: smp.save/smp.load (partial) against torch.save/torch.load and
torch.distributed.checkpoint (DCP) of the same tensors, in the same run.

2 ranks at pp=2 (Gloo, loopback), a ~200 MB model (48 x Linear(1024, 1024)), so each
rank saves and loads its ~100 MB part. smp's save includes sealing (XXH3 of the file,
manifest), fsync of the file, the rename and fsync of the directory; its load reads and
verifies every byte before unpickling. torch's save gets the same fsync (file and
directory), so both pay for the disk alike; torch's save without fsync is reported too.
DCP (torch >= 2.2) writes with FileSystemWriter(sync_files=True) (fsync of each file):
`dcp.save`, and `dcp.async_save` timed twice, "blocked" (until the call returns and
training could go on: staging a copy and starting the upload thread) and "total" (until
its future completes: the files are written and synced); also with the writer's
`cache_staged_state_dict=True` (the staging buffers reused from save to save), the best
a user can pick on a CPU. smp's save is synchronous: blocked = total.
Rounds alternate which side goes first; medians, the slower rank counts.

Resharding, in two more jobs: the pp=2 job's last saves load into a pp=1 job (one rank
reads both parts), whose saves then load into a pp=2 job (each rank needs half of one
part). smp: `smp.load(partial=True)` + `model.load_state_dict` (reads the parts that
hold the rank's layers, then the pp group exchanges entries); DCP: `dcp.load` into the
model's own state dict (in place, only the tensors the rank holds). Both are timed until
the model's parameters hold the saved values, which is checked after every load.
One JSON line.

    PYTHONPATH=build/python .venv/bin/python bench/checkpoint.py [--rounds 5] [--dir DIR]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import _malloc  # bench/_malloc.py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BUILD = os.environ.get("SMP_BUILD_DIR", os.path.join(REPO, "build"))
LAYERS, WIDTH = 48, 1024


def dcp_module():
    """torch.distributed.checkpoint with save/async_save/load, or the reason it is not
    there (a string)."""
    import torch
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as exc:
        return f"unavailable on torch {torch.__version__}: {exc}"
    if not all(hasattr(dcp, n) for n in ("save", "async_save", "load")):
        return f"unavailable on torch {torch.__version__}: no dcp.save/async_save/load"
    return dcp


def setup(pp, seed=0):
    """smp at pp ranks, the model partitioned; returns (smp, torch, model, net)."""
    import torch
    import torch.nn as nn
    import smp
    torch.set_num_threads(1)
    smp.init({"partitions": pp, "microbatches": 1})
    torch.manual_seed(seed)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    model = smp.DistributedModel(net)

    @smp.step
    def fwd(x):
        return model(x)

    fwd(torch.randn(1, WIDTH))  # partitions the model
    return smp, torch, model, net


def tensors(sd, torch):
    return {k: v for k, v in sd.items() if torch.is_tensor(v)}


def fsync_dir(path):
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timer(smp):
    def timed(fn):
        smp.barrier()
        t = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t) * 1e3, out
    return timed


def worker_same(args):
    """pp=2: smp vs torch.save/load vs DCP at the same layout; leaves smp.pt_* and
    dcp_2/ for the resharding job."""
    smp, torch, model, _ = setup(2)
    sd = model.local_state_dict()
    ts = tensors(sd, torch)
    mb = sum(v.numel() * v.element_size() for v in ts.values()) / 2**20
    smp_f = os.path.join(args.dir, "smp.pt")
    torch_f = os.path.join(args.dir, f"torch.pt_{smp.pp_rank()}")
    dcp = dcp_module()
    dcp_errors = {}
    timed = timer(smp)

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

    def check(got):
        for k, v in ts.items():
            assert torch.equal(got[k], v), k

    sides = ["smp", "torch"]
    saves = {"smp": smp_save, "torch": torch_save}
    loads = {"smp": lambda: smp.load(smp_f, partial=True), "torch": lambda: torch.load(torch_f)}
    if not isinstance(dcp, str):
        from torch.distributed.checkpoint import FileSystemWriter
        dcp_dir = os.path.join(args.dir, "dcp_2")
        cached = FileSystemWriter(os.path.join(args.dir, "dcp_async_cached"),
                                  cache_staged_state_dict=True)

        def async_save(writer_fn):
            def run():
                t = time.perf_counter()
                fut = dcp.async_save(ts, storage_writer=writer_fn())
                blocked = (time.perf_counter() - t) * 1e3
                (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
                return blocked
            return run

        def dcp_save():
            dcp.save(ts, storage_writer=FileSystemWriter(dcp_dir))
        saves["dcp"] = dcp_save
        saves["dcp_async"] = async_save(
            lambda: FileSystemWriter(os.path.join(args.dir, "dcp_async")))
        saves["dcp_async_cached"] = async_save(lambda: cached)
        # The cached staging pins its buffers: on a CUDA build of torch without a GPU
        # that raises. Probed once, agreed by every rank, reported in the JSON line.
        try:
            saves["dcp_async_cached"]()
            err = None
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"[:300]
        errors = [e for e in smp.allgather(err) if e]
        if errors:
            del saves["dcp_async_cached"]
            dcp_errors["dcp_async_cached"] = errors[0]

        def dcp_load():
            got = {k: torch.empty_like(v) for k, v in ts.items()}
            dcp.load(got, checkpoint_id=dcp_dir)
            return got
        loads["dcp"] = dcp_load
        sides.append("dcp")

    # Each result is dropped before the next load (neither side gets the other's freed
    # memory), the order rotates, and nothing leaves dirty pages behind for the other
    # side's fsync to flush (the unsynced torch.save runs last, once).
    times = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        res = {}
        order = sides[r % len(sides):] + sides[:r % len(sides)]
        save_order = [n for who in order for n in saves if n.split("_")[0] == who]
        for name in save_order:
            ms, blocked = timed(saves[name])
            res[name + "_save"] = ms
            if blocked is not None:
                res[name + "_save_blocked"] = blocked
        for who in order:
            ms, got = timed(loads[who])
            check(got)
            del got
            res[who + "_load"] = ms
        if r:
            for k, v in res.items():
                times.setdefault(k, []).append(v)
    times["torch_save_nosync"] = [timed(torch_save_nosync)[0]]
    med = {k: statistics.median(v) for k, v in times.items()}
    allm = smp.allgather(med)
    if smp.rank() == 0:
        worst = {k: max(m[k] for m in allm) for k in med}
        out = {
            "bench": "checkpoint", "world": smp.size(), "pp": 2, "mb_per_rank": round(mb, 1),
            "smp_save_ms": round(worst["smp_save"], 1),
            "torch_save_fsync_ms": round(worst["torch_save"], 1),
            "torch_save_nofsync_ms": round(worst["torch_save_nosync"], 1),
            "save_ratio": round(worst["smp_save"] / worst["torch_save"], 3),
            "smp_load_ms": round(worst["smp_load"], 1),
            "torch_load_ms": round(worst["torch_load"], 1),
            "load_ratio": round(worst["smp_load"] / worst["torch_load"], 3),
            "torch": torch.__version__}
        if isinstance(dcp, str):
            out["dcp"] = dcp
        else:
            out.update({
                "dcp_save_ms": round(worst["dcp_save"], 1),
                "dcp_async_blocked_ms": round(worst["dcp_async_save_blocked"], 1),
                "dcp_async_total_ms": round(worst["dcp_async_save"], 1),
                "dcp_load_ms": round(worst["dcp_load"], 1)})
            blocked = [worst["dcp_save"], worst["dcp_async_save_blocked"]]
            if "dcp_async_cached_save" in worst:
                out["dcp_async_cached_blocked_ms"] = round(
                    worst["dcp_async_cached_save_blocked"], 1)
                out["dcp_async_cached_total_ms"] = round(worst["dcp_async_cached_save"], 1)
                blocked.append(worst["dcp_async_cached_save_blocked"])
            if dcp_errors:
                out["dcp_errors"] = dcp_errors
            best_blocked = min(blocked)
            out["save_blocked_ratio_vs_dcp"] = round(worst["smp_save"] / best_blocked, 3)
            out["save_total_ratio_vs_dcp"] = round(worst["smp_save"] / worst["dcp_save"], 3)
            out["load_ratio_vs_dcp"] = round(worst["smp_load"] / worst["dcp_load"], 3)
        print("RESULT " + json.dumps(out))


def worker_reshard(args):
    """pp=args.pp: load what a job at another pp saved (smp and DCP, alternated), check
    it, then save at this layout for the next job."""
    smp, torch, model, net = setup(args.pp, seed=1)  # other weights than the saved ones
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    ref = ref.state_dict()  # what every saving job saved (seed 0)
    local = tensors(model.local_state_dict(), torch)
    dcp = dcp_module()
    timed = timer(smp)
    src_smp = os.path.join(args.dir, args.src + ".pt")
    src_dcp = os.path.join(args.dir, "dcp_" + args.src_pp)

    def scramble():
        with torch.no_grad():
            for v in local.values():
                v.zero_()
        # The state dict's tensors are the parameters' own storage (so DCP loads into
        # the model, and the check after each load sees what that load wrote).
        assert all(not p.any() for p in model.local_parameters()), "scramble missed"

    def check():
        for k, v in tensors(model.local_state_dict(), torch).items():
            assert torch.equal(v, ref[k]), k

    def smp_load():
        model.load_state_dict(smp.load(src_smp, partial=True))

    loads = {"smp": smp_load}
    if not isinstance(dcp, str):
        # In place into this rank's own parameters: only the tensors it holds are read.
        loads["dcp"] = lambda: dcp.load(local, checkpoint_id=src_dcp)
    times = {k: [] for k in loads}
    for r in range(args.rounds + 1):
        order = list(loads) if r % 2 else list(loads)[::-1]
        for who in order:
            scramble()
            ms, _ = timed(loads[who])
            check()
            if r:
                times[who].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    allm = smp.allgather(med)
    # The next job's sources, written at this layout.
    smp.save(model.local_state_dict(), os.path.join(args.dir, f"smp{args.pp}.pt"),
             partial=True)
    if not isinstance(dcp, str):
        from torch.distributed.checkpoint import FileSystemWriter
        dcp.save(local, storage_writer=FileSystemWriter(
            os.path.join(args.dir, f"dcp_{args.pp}")))
    if smp.rank() == 0:
        worst = {k: max(m[k] for m in allm) for k in med}
        out = {"from_pp": int(args.src_pp), "to_pp": args.pp,
               "smp_ms": round(worst["smp"], 1)}
        if "dcp" in worst:
            out.update({"dcp_ms": round(worst["dcp"], 1),
                        "ratio_vs_dcp": round(worst["smp"] / worst["dcp"], 3)})
        else:
            out["dcp"] = dcp
        print("RESULT " + json.dumps(out))


def launch(args, d, nproc, extra):
    # Note [Fixed mmap threshold] (smp_core/runtime.h): smp's default, on both sides.
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               **_malloc.SMP_DEFAULT,
               SMP_PYTHON=sys.executable)
    cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", str(nproc), __file__,
           "--rounds", str(args.rounds), "--dir", d] + extra
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in out.stdout.splitlines() if "RESULT " in ln]
    if out.returncode or not line:
        sys.exit(f"checkpoint bench failed ({' '.join(extra)}):\n{out.stdout[-3000:]}\n"
                 f"{out.stderr[-3000:]}")
    return json.loads(line[0].split("RESULT ", 1)[1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--src", default=None, help="resharding job: smp save's name")
    parser.add_argument("--src-pp", default=None, help="resharding job: the saving pp")
    args = parser.parse_args()
    if "RANK" in os.environ:
        return worker_reshard(args) if args.src else worker_same(args)
    with tempfile.TemporaryDirectory(dir=args.dir or None, prefix="smp_bench_ckpt_") as d:
        out = launch(args, d, 2, [])
        # pp=2 -> pp=1 (one rank reads both parts), then pp=1 -> pp=2 (each rank half of
        # one part); each resharding job saves the next one's source.
        to1 = launch(args, d, 1, ["--pp", "1", "--src", "smp", "--src-pp", "2"])
        to2 = launch(args, d, 2, ["--pp", "2", "--src", "smp1", "--src-pp", "1"])
        shutil.rmtree(d, ignore_errors=True)
    out["reshard"] = [to1, to2]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
