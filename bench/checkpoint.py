"""Checkpoint benchmark: smp.save/smp.load (partial) against torch.save/torch.load and
torch.distributed.checkpoint (DCP) of the same tensors, in the same run.

2 ranks at pp=2 (Gloo, loopback), a ~200 MB model (48 x Linear(1024, 1024)), so each
rank saves and loads its ~100 MB part. smp's save includes sealing (XXH3 of the file,
manifest), fsync of the file, the rename and fsync of the directory. torch's save gets
the same fsync (file and directory), so both pay for the disk alike; torch's save without
fsync is reported too. DCP (torch >= 2.2) writes with FileSystemWriter(sync_files=True)
(fsync of each file): `dcp.save`, and `dcp.async_save` timed twice, "blocked" (until the
call returns and training could go on: staging a copy and starting the upload thread)
and "total" (until its future completes: the files are written and synced); also with
the writer's `cache_staged_state_dict=True` (the staging buffers reused from save to
save), the best a user can pick on a CPU.
Rounds alternate which side goes first; medians, the slower rank counts. The saving
sides (same layout):
- `smp_save_ms`: `smp.save(sd, f, partial=True)`, synchronous (blocked = total);
  `save_ratio` is it over `torch_save_fsync_ms`; `save_blocked_ratio_vs_dcp` over the
  least blocked of DCP's three, `save_total_ratio_vs_dcp` over `dcp_save_ms`.
- `smp_async_blocked_ms` / `smp_async_total_ms`: `smp.save(sd, f2, partial=True,
  async_save=True)` timed until it returns (blocked: pickling the structure and copying
  every tensor's bytes into host buffers reused from save to save; C++'s writer thread
  does the rest) and until `future.wait()` returns (total: written, hashed, sealed, the
  file fsynced, renamed, the directory fsynced, and the pp group agreed on the outcome;
  wait() is collective over the pp group, every rank calls it). Against DCP's best
  async variant a user could pick: `async_blocked_ratio_vs_dcp` = smp blocked / min of
  `dcp_async_blocked_ms`, `dcp_async_cached_blocked_ms` (pinned staging: fails on a CUDA
  build without a GPU, reported in `dcp_errors`) and `dcp_async_stager[bg]_blocked_ms`
  (DCP's DefaultStager without pinned or shared memory, its buffers reused from save to
  save; blocked until its staging completed, staged in the call or, `bg`, on DCP's
  thread), `async_total_ratio_vs_dcp` = smp total / min of their totals (targets
  <= 1.0). Same fsync on both sides.
The loading sides (same layout; every load is checked against the saved values):
- `smp_load_ms`: `smp.load(f, partial=True)` (reads the rank's part whole, verifies
  every byte, unpickles into fresh tensors); `torch_load_ms`: `torch.load`;
  `dcp_load_ms`: `dcp.load` into fresh tensors (`empty_like`); `load_ratio` = smp over
  torch, `load_ratio_vs_dcp` = smp over DCP into fresh tensors.
- `smp_load_entry_ms`: `smp.resume_from_checkpoint(dir, tag="same", partial=True,
  load_optimizer=False)` of a `smp.save_checkpoint` written once before the rounds:
  reads by entry (maps every part, unpickles the structure, verifies and copies into
  the model's own parameters only the tensors the rank keeps), in place.
  `dcp_load_inplace_ms`: `dcp.load` into this rank's own parameter tensors (the model's
  local state dict, whose tensors are checked to alias the parameters). Before each
  in-place load the parameters are zeroed, after it they are compared with the saved
  values. `load_entry_ratio_vs_dcp` = smp by entry / min(DCP in place, DCP into fresh
  tensors) (target <= 0.72).

Resharding, in two more jobs: the pp=2 job's last saves load into a pp=1 job (one rank
reads both parts), whose saves then load into a pp=2 job (each rank needs half of one
part). Each entry of `reshard` reports `entry_ms` (smp by entry:
`smp.resume_from_checkpoint(dir, tag=..., load_optimizer=False)` of the saving job's
`save_checkpoint`, verifying and copying in place only what the rank keeps),
`whole_ms` (`smp.load(partial=True)` + `model.load_state_dict`: reads the parts that
hold the rank's layers whole, then the pp group exchanges entries), `dcp_ms`
(`dcp.load` into the model's own state dict: in place, only the tensors the rank
holds), `ratio_vs_dcp` = entry / dcp (target <= 0.8) and `whole_ratio_vs_dcp`. Each is
timed until the model's parameters hold the saved values (zeroed before, checked after
every load). One JSON line.

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


def aliases_parameters(model, local):
    """Whether `local`'s tensors are the model's own parameters (one each)."""
    params = {p.data_ptr() for p in model.local_parameters()}
    return len(params) == len(local) and {v.data_ptr() for v in local.values()} == params


def in_place(torch, model, local, ref):
    """(scramble, check) for loads into the model's own parameters: zero them (through
    `local`, their state dict's tensors), then after the load, compare them with `ref`
    and check `local` still aliases them (the load copied in, replaced nothing)."""
    assert aliases_parameters(model, local), "the state dict's tensors are not the parameters"

    def scramble():
        with torch.no_grad():
            for v in local.values():
                v.zero_()
        assert all(not p.any() for p in model.local_parameters()), "scramble missed"

    def check():
        now = tensors(model.local_state_dict(), torch)
        assert set(now) == set(ref), sorted(set(now) ^ set(ref))
        for k, v in now.items():
            assert torch.equal(v, ref[k]), k
            assert v.data_ptr() == local[k].data_ptr(), f"{k}: the load replaced the storage"
    return scramble, check


def worker_same(args):
    """pp=2: smp vs torch.save/load vs DCP at the same layout; leaves smp.pt_*, dcp_2/
    and ckpt/same_partial/ for the resharding job."""
    smp, torch, model, _ = setup(2)
    sd = model.local_state_dict()
    ts = tensors(sd, torch)  # the parameters themselves (checked by in_place)
    ref = {k: v.clone() for k, v in ts.items()}  # what every save holds
    mb = sum(v.numel() * v.element_size() for v in ts.values()) / 2**20
    smp_f = os.path.join(args.dir, "smp.pt")
    smp_async_f = os.path.join(args.dir, "smp_async.pt")
    ckpt = os.path.join(args.dir, "ckpt")
    torch_f = os.path.join(args.dir, f"torch.pt_{smp.pp_rank()}")
    dcp = dcp_module()
    dcp_errors = {}
    timed = timer(smp)
    scramble, check_model = in_place(torch, model, ts, ref)
    # The by-entry load's source (and the pp=2 source of the resharding job).
    smp.save_checkpoint(ckpt, "same", partial=True, model=model, optimizer=None)

    def smp_save():
        smp.save(sd, smp_f, partial=True)

    def smp_async_save():
        t = time.perf_counter()
        fut = smp.save(sd, smp_async_f, partial=True, async_save=True)
        blocked = (time.perf_counter() - t) * 1e3
        fut.wait()  # collective over the pp group: every rank of the save calls it
        return blocked

    def torch_save():
        with open(torch_f, "wb") as fh:
            torch.save(sd, fh)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(torch_f)

    def torch_save_nosync():
        torch.save(sd, torch_f)

    def check(got):
        for k, v in ref.items():
            assert torch.equal(got[k], v), k

    def smp_load_entry():
        smp.resume_from_checkpoint(ckpt, tag="same", partial=True, load_optimizer=False)

    sides = ["smp", "torch"]
    saves = {"smp": smp_save, "smp_async": smp_async_save, "torch": torch_save}
    # name -> (load, in place): in place loads write the parameters (zeroed before);
    # the others return what they read.
    loads = {"smp": (lambda: smp.load(smp_f, partial=True), False),
             "smp_entry": (smp_load_entry, True),
             "torch": (lambda: torch.load(torch_f), False)}
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
        # DCP's stager (torch >= 2.8) without pinned or shared memory, the CPU user's
        # pick: its staging buffers are reused from save to save. Blocked = until its
        # staging completed (training may change the tensors from then on), whether
        # that staging runs inside the call or on DCP's thread; the better of the two.
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:
            DefaultStager = None
        if DefaultStager is not None:
            def stager_save(async_staging):
                stager = DefaultStager(StagingOptions(
                    use_pinned_memory=False, use_shared_memory=False,
                    use_async_staging=async_staging, use_non_blocking_copy=False))
                writer = os.path.join(args.dir, f"dcp_async_stager_{int(async_staging)}")

                def run():
                    t = time.perf_counter()
                    resp = dcp.async_save(ts, storage_writer=FileSystemWriter(writer),
                                          async_stager=stager)
                    staged = getattr(resp, "staging_completion", None)
                    if staged is not None:
                        staged.result()
                    blocked = (time.perf_counter() - t) * 1e3
                    getattr(resp, "upload_completion", resp).result()
                    return blocked
                return run
            saves["dcp_async_stager"] = stager_save(False)
            saves["dcp_async_stagerbg"] = stager_save(True)
        # The cached staging pins its buffers: on a CUDA build of torch without a GPU
        # that raises. Each variant is probed once, agreed by every rank, and a failure
        # is reported in the JSON line.
        for variant in ("dcp_async_cached", "dcp_async_stager", "dcp_async_stagerbg"):
            if variant not in saves:
                continue
            try:
                saves[variant]()
                err = None
            except Exception as exc:
                err = f"{type(exc).__name__}: {exc}"[:300]
            errors = [e for e in smp.allgather(err) if e]
            if errors:
                del saves[variant]
                dcp_errors[variant] = errors[0]

        def dcp_load():
            got = {k: torch.empty_like(v) for k, v in ts.items()}
            dcp.load(got, checkpoint_id=dcp_dir)
            return got
        loads["dcp"] = (dcp_load, False)
        # In place into this rank's own parameters, as smp's by-entry load.
        loads["dcp_inplace"] = (lambda: dcp.load(ts, checkpoint_id=dcp_dir), True)
        sides.append("dcp")

    # Each result is dropped before the next load (neither side gets the other's freed
    # memory), the order rotates, and nothing leaves dirty pages behind for the other
    # side's fsync to flush (the unsynced torch.save runs last, once).
    times = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        res = {}
        order = sides[r % len(sides):] + sides[:r % len(sides)]
        save_order = [n for who in order for n in saves if n.split("_")[0] == who]
        load_order = [n for who in order for n in loads if n.split("_")[0] == who]
        for name in save_order:
            ms, blocked = timed(saves[name])
            res[name + "_save"] = ms
            if blocked is not None:
                res[name + "_save_blocked"] = blocked
        for name in load_order:
            fn, inplace = loads[name]
            if inplace:
                scramble()
            ms, got = timed(fn)
            if inplace:
                check_model()
            else:
                check(got)
            del got
            res[name + "_load"] = ms
        if r:
            for k, v in res.items():
                times.setdefault(k, []).append(v)
    check(smp.load(smp_async_f, partial=True))  # the asynchronous save's files hold sd
    times["torch_save_nosync"] = [timed(torch_save_nosync)[0]]
    med = {k: statistics.median(v) for k, v in times.items()}
    allm = smp.allgather(med)
    if smp.rank() == 0:
        worst = {k: max(m[k] for m in allm) for k in med}
        out = {
            "bench": "checkpoint", "world": smp.size(), "pp": 2, "mb_per_rank": round(mb, 1),
            "smp_save_ms": round(worst["smp_save"], 1),
            "smp_async_blocked_ms": round(worst["smp_async_save_blocked"], 1),
            "smp_async_total_ms": round(worst["smp_async_save"], 1),
            "torch_save_fsync_ms": round(worst["torch_save"], 1),
            "torch_save_nofsync_ms": round(worst["torch_save_nosync"], 1),
            "save_ratio": round(worst["smp_save"] / worst["torch_save"], 3),
            "smp_load_ms": round(worst["smp_load"], 1),
            "smp_load_entry_ms": round(worst["smp_entry_load"], 1),
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
                "dcp_load_ms": round(worst["dcp_load"], 1),
                "dcp_load_inplace_ms": round(worst["dcp_inplace_load"], 1)})
            blocked = [worst["dcp_save"], worst["dcp_async_save_blocked"]]
            async_blocked = [worst["dcp_async_save_blocked"]]
            async_total = [worst["dcp_async_save"]]
            if "dcp_async_cached_save" in worst:
                out["dcp_async_cached_blocked_ms"] = round(
                    worst["dcp_async_cached_save_blocked"], 1)
                out["dcp_async_cached_total_ms"] = round(worst["dcp_async_cached_save"], 1)
                blocked.append(worst["dcp_async_cached_save_blocked"])
                async_blocked.append(worst["dcp_async_cached_save_blocked"])
                async_total.append(worst["dcp_async_cached_save"])
            for variant in ("dcp_async_stager", "dcp_async_stagerbg"):
                if variant + "_save" in worst:
                    out[variant + "_blocked_ms"] = round(worst[variant + "_save_blocked"], 1)
                    out[variant + "_total_ms"] = round(worst[variant + "_save"], 1)
                    blocked.append(worst[variant + "_save_blocked"])
                    async_blocked.append(worst[variant + "_save_blocked"])
                    async_total.append(worst[variant + "_save"])
            if dcp_errors:
                out["dcp_errors"] = dcp_errors
            best_blocked = min(blocked)
            out["save_blocked_ratio_vs_dcp"] = round(worst["smp_save"] / best_blocked, 3)
            out["save_total_ratio_vs_dcp"] = round(worst["smp_save"] / worst["dcp_save"], 3)
            out["async_blocked_ratio_vs_dcp"] = round(
                worst["smp_async_save_blocked"] / min(async_blocked), 3)
            out["async_total_ratio_vs_dcp"] = round(
                worst["smp_async_save"] / min(async_total), 3)
            out["load_ratio_vs_dcp"] = round(worst["smp_load"] / worst["dcp_load"], 3)
            out["load_entry_ratio_vs_dcp"] = round(
                worst["smp_entry_load"] / min(worst["dcp_inplace_load"], worst["dcp_load"]), 3)
        print("RESULT " + json.dumps(out))


def worker_reshard(args):
    """pp=args.pp: load what a job at another pp saved (smp by entry, smp whole and DCP,
    alternated), check it, then save at this layout for the next job."""
    smp, torch, model, net = setup(args.pp, seed=1)  # other weights than the saved ones
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    ref = ref.state_dict()  # what every saving job saved (seed 0)
    # The state dict's tensors are the parameters' own storage (so DCP loads into the
    # model, and the check after each load sees what that load wrote).
    local = tensors(model.local_state_dict(), torch)
    ref = {k: ref[k] for k in local}
    scramble, check = in_place(torch, model, local, ref)
    dcp = dcp_module()
    timed = timer(smp)
    ckpt = os.path.join(args.dir, "ckpt")
    src_smp = os.path.join(args.dir, args.src + ".pt")
    src_dcp = os.path.join(args.dir, "dcp_" + args.src_pp)

    def smp_whole():
        model.load_state_dict(smp.load(src_smp, partial=True))

    def smp_entry():
        smp.resume_from_checkpoint(ckpt, tag=args.src_tag, partial=True, load_optimizer=False)

    loads = {"smp_entry": smp_entry, "smp_whole": smp_whole}
    if not isinstance(dcp, str):
        # In place into this rank's own parameters: only the tensors it holds are read.
        loads["dcp"] = lambda: dcp.load(local, checkpoint_id=src_dcp)
    times = {k: [] for k in loads}
    for r in range(args.rounds + 1):
        order = list(loads)[r % len(loads):] + list(loads)[:r % len(loads)]
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
    smp.save_checkpoint(ckpt, f"pp{args.pp}", partial=True, model=model, optimizer=None)
    if not isinstance(dcp, str):
        from torch.distributed.checkpoint import FileSystemWriter
        dcp.save(local, storage_writer=FileSystemWriter(
            os.path.join(args.dir, f"dcp_{args.pp}")))
    if smp.rank() == 0:
        worst = {k: max(m[k] for m in allm) for k in med}
        out = {"from_pp": int(args.src_pp), "to_pp": args.pp,
               "entry_ms": round(worst["smp_entry"], 1),
               "whole_ms": round(worst["smp_whole"], 1)}
        if "dcp" in worst:
            out.update({"dcp_ms": round(worst["dcp"], 1),
                        "ratio_vs_dcp": round(worst["smp_entry"] / worst["dcp"], 3),
                        "whole_ratio_vs_dcp": round(worst["smp_whole"] / worst["dcp"], 3)})
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
    parser.add_argument("--src-tag", default=None,
                        help="resharding job: the saving job's save_checkpoint tag")
    args = parser.parse_args()
    if "RANK" in os.environ:
        return worker_reshard(args) if args.src else worker_same(args)
    with tempfile.TemporaryDirectory(dir=args.dir or None, prefix="smp_bench_ckpt_") as d:
        out = launch(args, d, 2, [])
        # pp=2 -> pp=1 (one rank reads both parts), then pp=1 -> pp=2 (each rank half of
        # one part); each resharding job saves the next one's source.
        to1 = launch(args, d, 1, ["--pp", "1", "--src", "smp", "--src-pp", "2",
                                  "--src-tag", "same"])
        to2 = launch(args, d, 2, ["--pp", "2", "--src", "smp1", "--src-pp", "1",
                                  "--src-tag", "pp1"])
        shutil.rmtree(d, ignore_errors=True)
    out["reshard"] = [to1, to2]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
