"""The torch peer of bench/pipeline.py: torch.distributed.pipelining on the same model,
the same stage split, the same batch and microbatches, the same data and seed.

Run by bench/pipeline.py under smprun (2 ranks, Gloo, one thread each); every schedule
a user of torch 2.x could pick for 2 ranks runs in the same processes, one block of
steps each in turn, so drift of the machine hits them alike:

- GPipe and 1F1B: one stage per rank, exactly smp's split (`--split`, from smp's
  `partition_plan()` in the same run).
- Interleaved1F1B, LoopedBFS, InterleavedZeroBubble (looped: rank r holds stages r and
  r + 2) and ZBVZeroBubble, DualPipeV (V: rank 0 holds stages 0 and 3): each of smp's
  two stages cut in two halves of equal layers, so every rank holds the same layers'
  worth of work as under smp.

A schedule that fails (construction or step) is reported with its error text, not
fatal. Prints one line "RESULT {json}" on rank 0: ms/step of each schedule (the slower
rank), its first loss, and errors.

    smprun --nproc_per_node 2 bench/pipeline_torch.py --split 0,0,...,1 [--steps 20]
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

__all__ = []

SINGLE = ["GPipe", "1F1B"]
LOOPED = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"]
V_SHAPE = ["ZBVZeroBubble", "DualPipeV"]


def stage_layers(split, schedule, rank):
    """Indices of the top-level children of each stage this rank holds, and the stage
    indices. split[i] is the pp rank smp gave child i."""
    parts = [[i for i, p in enumerate(split) if p == r] for r in range(2)]
    if schedule in SINGLE:
        return [parts[rank]], [rank], 2
    halves = []
    for part in parts:  # cut each of smp's stages at a layer boundary near its middle
        linears = [i for i in part if i % 2 == 0]
        cut = linears[len(linears) // 2]
        halves += [[i for i in part if i < cut], [i for i in part if i >= cut]]
    if schedule in LOOPED:
        stages = [rank, rank + 2]
    else:
        stages = [0, 3] if rank == 0 else [1, 2]
    return [halves[s] for s in stages], stages, 4


def make_schedule(name, stages, loss_fn, microbatches):
    from torch.distributed import pipelining as pp
    cls = getattr(pp, "Schedule" + name)
    if name in SINGLE:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--split", required=True, help="pp rank of each top-level child")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--schedules", default=",".join(SINGLE + LOOPED + V_SHAPE),
                        help="comma-separated subset to run")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from pipeline import BATCH, M, WIDTH, build_model
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    split = [int(v) for v in args.split.split(",")]
    out = {"torch": torch.__version__, "ms": {}, "loss0": {}, "errors": {}}
    try:
        from torch.distributed import pipelining  # noqa: F401 (torch >= 2.4)
    except ImportError as exc:
        if rank == 0:
            out["errors"]["all"] = f"unavailable on torch {torch.__version__}: {exc}"
            print("RESULT " + json.dumps(out))
        return
    from torch.distributed.pipelining import PipelineStage

    def loss_fn(output, target):
        return nn.functional.cross_entropy(output, target)

    runners = {}
    for name in args.schedules.split(","):
        try:
            torch.manual_seed(0)
            net = build_model()  # same seed: the same weights as smp's and single's
            x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
            layer_sets, indices, n = stage_layers(split, name, rank)
            mods = [nn.Sequential(*[net[i] for i in layers]) for layers in layer_sets]
            stages = [PipelineStage(m, i, n, torch.device("cpu")) for m, i in zip(mods, indices)]
            sched = make_schedule(name, stages, loss_fn, M)
            params = [p for m in mods for p in m.parameters()]
            opt = torch.optim.SGD(params, lr=0.01)
            first = 0 in indices
            last = (n - 1) in indices

            def step(sched=sched, opt=opt, first=first, last=last, x=x, y=y):
                losses = []
                sched.step(*([x] if first else []), target=y if last else None,
                           losses=losses if last else None)
                opt.step()
                opt.zero_grad()
                return (torch.stack(losses).mean().item() if losses else None)

            loss0 = step()
            for _ in range(2):
                step()
            runners[name] = step
            out["loss0"][name] = loss0
        except Exception as exc:  # reported, not fatal: the other schedules still run
            out["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
            if os.environ.get("SMP_BENCH_TRACE"):
                traceback.print_exc()
        # Every rank must agree on which schedules run, or the next collective hangs.
        ok = torch.tensor([0 if name in out["errors"] else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item() and name in runners:
            del runners[name]
            out["errors"].setdefault(name, "failed on another rank")
    times = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, step in runners.items():
            dist.barrier()
            t = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - t) / args.steps * 1e3)
    mine = {name: statistics.median(v) for name, v in times.items()}
    gathered = [None, None]
    dist.all_gather_object(gathered, {"ms": mine, "loss0": out["loss0"],
                                      "errors": out["errors"]})
    if rank == 0:
        for name in mine:
            out["ms"][name] = max(g["ms"][name] for g in gathered)
        for g in gathered:  # the last stage's rank has the losses
            out["loss0"].update({k: v for k, v in g["loss0"].items() if v is not None})
            for k, v in g["errors"].items():
                out["errors"].setdefault(k, v)
        print("RESULT " + json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
