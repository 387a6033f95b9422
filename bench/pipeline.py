"""Pipeline benchmark: 8x (Linear(768,768)+GELU) + head, batch 256, one thread per rank.

smp with pp=2, microbatches=8 ("interleaved", and "simple" for memory) against
torch.distributed.pipelining's schedules on the same model, the same stage split (smp's
partition), the same microbatches, data and seed (bench/pipeline_torch.py; torch >= 2.4),
and against the same model trained in one process (whole batch), measured alternately in
the same run, with the same threads and allocator on every side. Prints one JSON line:
`ratio` = smp's step over the best torch schedule's (`torch_pp_ms` has each schedule,
`torch_pp_errors` any that failed or is unavailable), `ratio_vs_torch_pp_ceiling` the
same for the best step this machine allows (below), ms/step of one process and the
speedup, the GPipe bound S*M/(S+M-1), the peak activation memory per rank for both
schedules, and this machine's parallel efficiency (one process alone vs two at once).

It also times the same model in one process on the same 8 microbatches one after the
other (gradient accumulation): the work a pipeline of this shape divides between its
ranks. On a CPU BLAS, 32-row GEMMs are less efficient than 256-row ones, so that work
exceeds the whole-batch step; `ceiling` = gpipe_bound * single_ms / single_mb_ms *
parallel efficiency is the speedup a perfect GPipe schedule could reach here, and
`pipeline_efficiency` = (single_mb_ms / smp_ms) / gpipe_bound is how close smp gets to
it. `pipeline_efficiency_ceiling` is the same figure for the best step this machine
allows: each rank's own forward + backward work, timed while the other rank runs its
own at the same time (the two ranks compete for the two cores' caches and memory),
plus the fill and drain; no schedule and no dispatch can beat it. Per request served:
`request_dispatch_ms` is the compute-token time that is not the module's own forward
or backward (smp's cost), `request_overhead_ms` the token time beyond the reference
work. Timed steps run without instrumentation; peak activation memory is measured in
separate steps with saved-tensor hooks. The reference work includes each rank's
optimizer step, which every side's timed step ends with.

`fraction_of_ceiling` is that best step over each schedule's step (issue 21's figure),
in the default order, where every schedule executes its plan; `smp_dynamic_schedule_ms`
has the dynamic order's steps.

The pp ranks run bound to their own cores (smprun --bind_cores, Note [Core binding] in
launcher/rank_process.h), as a user tuning for speed would run them; the torch peer's
figure for each schedule is its best of a bound and an unbound run.

    PYTHONPATH=build/python .venv/bin/python bench/pipeline.py [--rounds 3] [--steps 20]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import _malloc  # bench/_malloc.py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BUILD = os.environ.get("SMP_BUILD_DIR", os.path.join(REPO, "build"))
PYTHON = os.environ.get("SMP_PYTHON", sys.executable)  # every side on one torch
S, M, BATCH, WIDTH, DEPTH = 2, 8, 256, 768, 8


def build_model():
    import torch.nn as nn
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


class ActivationTracker:
    """Peak bytes of tensors saved for backward (parameters excluded), over threads."""

    def __init__(self, params):
        import torch
        self.torch = torch
        self.param_ptrs = {p.data_ptr() for p in params}
        self.live = self.peak = 0
        self.lock = threading.Lock()

    def context(self):
        tracker = self

        class Box:
            __slots__ = ("t", "n")

            def __init__(self, t, n):
                self.t, self.n = t, n

            def __del__(self):
                with tracker.lock:
                    tracker.live -= self.n

        def pack(t):
            n = 0 if t.data_ptr() in tracker.param_ptrs else t.numel() * t.element_size()
            with tracker.lock:
                tracker.live += n
                tracker.peak = max(tracker.peak, tracker.live)
            return Box(t, n)

        return self.torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t)


def run_single(steps, microbatches=1):
    import contextlib
    import torch
    import torch.nn as nn
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = build_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    tracker = ActivationTracker(net.parameters())

    def step(track=False):
        losses = []
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with tracker.context() if track else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(net(xs), ys)
            (loss / microbatches).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        return sum(losses) / len(losses)

    first = step()
    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - start) / steps * 1e3
    step(track=True)
    print(json.dumps({"ms": ms, "loss0": first, "peak_act_mb": tracker.peak / 2**20,
                      "param_mb": sum(p.numel() * p.element_size()
                                      for p in net.parameters()) / 2**20}))


def smp_training(build, batch, width, ckpt=False, **model_kwargs):
    """An smp rank's side of a bench, one thread: smp.init() (the job's config), the
    model `build()` makes from seed 0, wrapped (each child checkpointed with `ckpt`),
    SGD, one batch and the @smp.step that trains on it: (net, model, opt, train, x, y)."""
    import torch
    import torch.nn as nn
    import smp
    torch.set_num_threads(1)
    smp.init()
    torch.manual_seed(0)
    net = build()
    model = smp.DistributedModel(net, **model_kwargs)
    opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01))
    if ckpt:
        smp.set_activation_checkpointing(model.get_module(), strategy="each")
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))

    @smp.step
    def train(x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        model.backward(loss)
        return loss
    return net, model, opt, train, x, y


def run_pipeline(steps, overlap=True):
    import smp
    from smp import pipeline
    net, model, opt, train, x, y = smp_training(build_model, BATCH, WIDTH,
                                                overlapping_allreduce=overlap)
    first = train(x, y).reduce_mean().item()  # includes trace + partition
    opt.step()
    opt.zero_grad()
    for _ in range(2):
        train(x, y)
        opt.step()
        opt.zero_grad()
    s0 = model._engine.p2p.stats()
    d0 = model._engine.dispatch.stats()
    c0 = model._engine.compute_s
    start = time.perf_counter()
    for _ in range(steps):
        train(x, y)
        opt.step()
        opt.zero_grad()
    ms = (time.perf_counter() - start) / steps * 1e3
    s1 = model._engine.p2p.stats()
    d1 = model._engine.dispatch.stats()
    c1 = model._engine.compute_s
    # Python<->C++ crossings through the dispatcher per microbatch (issue 21: <= 3).
    crossings = round((d1.crossings - d0.crossings) / max(d1.microbatches - d0.microbatches, 1), 2)
    # Timed steps that executed the plan as written, and that left it (Note [Executed
    # plan] in smp_core/detail/plan_execution.cpp).
    planned = [d1.planned_steps - d0.planned_steps, d1.plan_fallbacks - d0.plan_fallbacks]
    # The share of each step this rank's compute token was held: 1 minus it is the
    # rank's measured bubble (plus its waits for the token's hand-over).
    busy = round((s1.token_held_s - s0.token_held_s) / steps * 1e3 / ms, 3)
    # The pp x dp runs report ms only; with ddp a backward outside @smp.step is refused.
    work = reference_work_ms(net, model, steps) if smp.dp_size() == 1 else None
    # Per request served on a stage rank (the driver runs the step body, not requests):
    # the compute-token time per step beyond the modules' own forward and backward in
    # those requests (dispatch), and beyond the reference work (overhead).
    overhead = dispatch = None
    if smp.pp_rank() and work is not None:
        # The requests this rank served (forward and backward), from the dispatcher: the
        # messages it received also count the driver's per-microbatch and plan words.
        requests = (d1.requests - d0.requests) / steps
        held = (s1.token_held_s - s0.token_held_s) / steps * 1e3
        dispatch = round((held - (c1 - c0) / steps * 1e3) / requests, 3)
        overhead = round((held - work) / requests, 3)
    tracker = ActivationTracker(list(model.local_parameters()))
    pipeline.Engine.task_context = tracker.context
    train(x, y)
    peaks = smp.allgather(tracker.peak / 2**20)
    params = smp.allgather(sum(p.numel() * p.element_size()
                               for p in model.local_parameters()) / 2**20)
    overheads = smp.allgather(overhead)
    dispatches = smp.allgather(dispatch)
    works = smp.allgather(work)
    crossings = smp.allgather(crossings)
    planned = smp.allgather(planned)
    busy = smp.allgather(busy)
    plan = model.partition_plan()
    split = [plan[str(i)]["partition"] for i in range(len(net))]
    if smp.rank() == 0:
        print("RESULT " + json.dumps({"ms": ms, "loss0": first, "peak_act_mb": peaks,
                                      "split": split,
                                      "param_mb": params, "request_overhead_ms": overheads,
                                      "request_dispatch_ms": dispatches,
                                      "crossings_per_microbatch": crossings,
                                      "planned_steps_and_fallbacks": planned,
                                      "token_busy": busy, "work_ms": works}))


def reference_work_ms(net, model, steps):
    """This rank's modules' forward + backward of a step's microbatches and the
    optimizer's step over their parameters (torch's SGD, as every side's step ends),
    run outside the pipeline: ms per step.

    Every rank runs its own modules' work at the same time (after a barrier), so the
    reference pays the same contention for the two cores and the memory system as the
    pipeline's compute did; measured alone on an idle machine it would be ~10-25%
    faster and that machine effect would be counted as smp's overhead."""
    import copy
    import torch
    import smp
    mine = {id(m) for m in model.local_modules()}
    # Copies: a backward on the model's own parameters outside @smp.step is refused by
    # the gradient guard (Note [Unreduced gradients] in smp_core/grad_guard.cpp).
    seq = copy.deepcopy(torch.nn.Sequential(*[m for m in net if id(m) in mine]))
    opt = torch.optim.SGD(seq.parameters(), lr=0.01)
    xs = torch.randn(BATCH // M, WIDTH)

    def work():
        for _ in range(M):
            inp = xs.clone().requires_grad_()
            out = seq(inp)
            out.backward(torch.ones_like(out))
        opt.step()
        opt.zero_grad()
    work()
    smp.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        work()
    alone = (time.perf_counter() - t) / steps * 1e3
    smp.barrier()
    return alone


# Note [Allocator]: with glibc's default malloc, the whole-batch step here spends much
# of its time in page faults (measured ~7k a step): freed 768 KiB activations are
# trimmed from the heap and faulted back in on the next step. Microbatch-sized tensors
# stay below that threshold, so the default allocator handicaps the baseline, not smp.
# The benchmark therefore measures everything twice, with smp's default allocator
# setting (fixed 4 MiB mmap and 16 MiB trim thresholds, Note [Fixed mmap threshold] in
# smp_core/runtime.h, given to the torch peer too) and with this tuning (no trimming, no mmap below 32 MiB) applied to BOTH sides alike.
TUNED_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
MALLOC = {"default": None, "tuned": TUNED_MALLOC}


def _python_env(malloc=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", SMP_PYTHON=PYTHON)
    env["PYTHONPATH"] = os.path.join(BUILD, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("GLIBC_TUNABLES", None)
    for name in _malloc.SMP_DEFAULT:
        env.pop(name, None)
    if malloc:
        env["GLIBC_TUNABLES"] = malloc
    else:  # Note [Fixed mmap threshold] (smp_core/runtime.h): smp's default, both sides
        env.update(_malloc.SMP_DEFAULT)
    return env


def single(steps, microbatches=1, malloc=None):
    out = subprocess.run([PYTHON, __file__, "--role", "single", "--steps", str(steps),
                          "--microbatches", str(microbatches)],
                         env=_python_env(malloc), capture_output=True, text=True, timeout=600)
    if out.returncode:
        sys.exit(f"single-process run failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def smprun(nproc, bind):
    """smprun's command line for `nproc` ranks, with each bound to its own cores where
    `bind` (Note [Core binding] in launcher/rank_process.h) and the machine has a core
    per rank."""
    cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", str(nproc)]
    return cmd + ["--bind_cores"] if bind and nproc <= len(os.sched_getaffinity(0)) else cmd


def pipelined(steps, schedule, malloc=None, dp=1, overlap=True, order=None, bind=True):
    """smp's run of `schedule`, in config 'pipeline_order' `order` (None: the default,
    "planned")."""
    cfg = {"partitions": S, "microbatches": M, "pipeline": schedule, "ddp": dp > 1}
    if order:
        cfg["pipeline_order"] = order
    cmd = smprun(S * dp, bind) + ["--config", json.dumps(cfg), __file__, "--role", "pp",
                                  "--steps", str(steps)]
    if not overlap:
        cmd.append("--no-overlap")
    out = subprocess.run(cmd, env=_python_env(malloc), capture_output=True, text=True,
                         timeout=600)
    line = [ln for ln in out.stdout.splitlines() if "RESULT " in ln]
    if out.returncode or not line:
        sys.exit(f"pipeline run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[0].split("RESULT ", 1)[1])


def torch_pipelining(steps, split, malloc=None):
    """torch.distributed.pipelining's schedules on smp's split (bench/pipeline_torch.py),
    each schedule's best of a run with the ranks bound to their own cores and one
    without: binding the ranks is a choice its users have too (smprun --bind_cores,
    torchrun's --numa-binding), and at pp=2 here it helps torch's schedules little."""
    runs = [_torch_pipelining(steps, split, malloc, bind) for bind in (True, False)]
    best = runs[0]
    for name, ms in runs[1]["ms"].items():
        if ms < best["ms"].get(name, float("inf")):
            best["ms"][name] = ms
            best["errors"].pop(name, None)
            best["loss0"][name] = runs[1]["loss0"][name]
    if "teardown" in runs[1]["errors"]:
        best["errors"].setdefault("teardown", runs[1]["errors"]["teardown"])
    return best


def _torch_pipelining(steps, split, malloc, bind):
    cmd = smprun(S, bind) + [os.path.join(HERE, "pipeline_torch.py"), "--steps", str(steps),
                             "--split", ",".join(map(str, split))]
    out = subprocess.run(cmd, env=_python_env(malloc), capture_output=True, text=True,
                         timeout=600)
    line = [ln for ln in out.stdout.splitlines() if "RESULT " in ln]
    if not line:
        sys.exit(f"torch pipelining run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = json.loads(line[0].split("RESULT ", 1)[1])
    if out.returncode:
        # Seen about once in ten runs: a torch rank aborts in its teardown, after every
        # schedule was timed and the figures gathered ("terminate called without an
        # active exception" at destroy_process_group). The figures stand; the line says so.
        result["errors"]["teardown"] = (f"exit status {out.returncode} after the result"
                                        f"{' (ranks bound)' if bind else ''}: "
                                        f"{out.stderr.strip().splitlines()[-1][:200]}")
    return result


def parallel_efficiency(steps, malloc):
    """One single-process run alone vs two at once: how much 2 busy cores slow each."""
    alone = single(steps, malloc=malloc)["ms"]
    env = _python_env(malloc)
    procs = [subprocess.Popen([PYTHON, __file__, "--role", "single", "--steps", str(steps)],
                              env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    both = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1])["ms"]
            for p in procs]
    return alone / statistics.mean(both)


def peer_figures(peers, smp_ms, loss0, sfx):
    """torch.distributed.pipelining's figures for the JSON line: each schedule's median
    ms/step over the rounds, the best one, smp's step over the best's, and every
    schedule's error text (unavailable, or failed on Gloo/CPU)."""
    names = [n for n in peers[0]["ms"] if all(n in p["ms"] for p in peers)]
    med = {n: round(statistics.median(p["ms"][n] for p in peers), 1) for n in names}
    errors = {k: v for p in peers for k, v in p["errors"].items()}
    for n, l0 in peers[0]["loss0"].items():  # the same first step as one process
        if abs(l0 - loss0) > 1e-4:
            errors[n] = f"first loss {l0} differs from one process's {loss0}"
            med.pop(n, None)
    fig = {"torch_pp_ms" + sfx: med}
    if errors:
        fig["torch_pp_errors" + sfx] = errors
    if med:
        best = min(med, key=med.get)
        fig.update({"torch_pp_best" + sfx: best, "torch_pp_best_ms" + sfx: med[best],
                    "ratio_vs_torch_pp" + sfx: round(smp_ms / med[best], 3)})
    return fig


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["bench", "single", "pp"], default="bench")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--no-overlap", action="store_true")
    args = parser.parse_args()
    if args.role == "single":
        return run_single(args.steps, args.microbatches)
    if args.role == "pp":
        return run_pipeline(args.steps, overlap=not args.no_overlap)
    import torch
    gpipe = S * M / (S + M - 1)
    out = {"bench": "pipeline", "pp": S, "microbatches": M, "batch": BATCH,
           "gpipe_bound": round(gpipe, 3)}
    for mode, malloc in MALLOC.items():
        singles, singles_mb, pipes, peers = [], [], [], []
        for _ in range(args.rounds):  # alternate, so drift of the machine hits all alike
            singles.append(single(args.steps, malloc=malloc))
            pipes.append(pipelined(args.steps, "interleaved", malloc))
            peers.append(torch_pipelining(args.steps, pipes[-1]["split"], malloc))
            singles_mb.append(single(args.steps, M, malloc))
        # Same seed, same first batch: the first losses agree (a correctness check).
        if abs(singles[0]["loss0"] - pipes[0]["loss0"]) > 1e-4:
            sys.exit(f"loss mismatch: single {singles[0]['loss0']} vs smp {pipes[0]['loss0']}")
        single_ms = statistics.median(s["ms"] for s in singles)
        single_mb_ms = statistics.median(s["ms"] for s in singles_mb)
        smp_ms = statistics.median(p["ms"] for p in pipes)
        efficiency = parallel_efficiency(args.steps, malloc)
        # What this machine allows a perfect schedule with no overhead at all: each
        # rank's forward + backward of the step's microbatches, timed with the other
        # rank doing the same at once (work_ms), bounds the step below by the slowest
        # rank's work plus the fill and drain (one microbatch of stage 0's work).
        works = [statistics.median(p["work_ms"][r] for p in pipes) for r in range(S)]
        best_ms = max(works) + works[0] / M
        if mode == "default":
            ceiling_ms = best_ms
        sfx = "" if mode == "default" else "_" + mode + "_malloc"
        out.update(peer_figures(peers, smp_ms, singles[0]["loss0"], sfx))
        if "torch_pp_best_ms" + sfx in out:  # what no overhead at all would give
            out["ratio_vs_torch_pp_ceiling" + sfx] = round(
                best_ms / out["torch_pp_best_ms" + sfx], 3)
        out.update({
            "smp_ms" + sfx: round(smp_ms, 1), "single_ms" + sfx: round(single_ms, 1),
            "speedup" + sfx: round(single_ms / smp_ms, 3),
            "single_mb_ms" + sfx: round(single_mb_ms, 1),
            "ceiling" + sfx: round(gpipe * single_ms / single_mb_ms * efficiency, 3),
            "pipeline_efficiency" + sfx: round(single_mb_ms / smp_ms / gpipe, 3),
            "pipeline_efficiency_ceiling" + sfx: round(single_mb_ms / best_ms / gpipe, 3),
            "rank_work_ms" + sfx: [round(w, 1) for w in works],
            "machine_parallel_efficiency" + sfx: round(efficiency, 3)})
        if mode == "default":
            # The headline: smp against the torch peer (the best torch.distributed.
            # pipelining schedule), else against one process where torch has none.
            out["ratio_vs_single"] = round(smp_ms / single_ms, 3)
            out["ratio"] = out.get("ratio_vs_torch_pp", out["ratio_vs_single"])
            out["peak_act_mb_interleaved"] = [round(v, 1) for v in pipes[0]["peak_act_mb"]]
            out["peak_act_mb_single"] = round(singles[0]["peak_act_mb"], 1)
        if mode == "default":
            # Parameters + peak activations per rank, against one process (issue target
            # <= 0.55): weights split by the partition, activations by the microbatches.
            one = singles[0]["param_mb"] + singles[0]["peak_act_mb"]
            per_rank = [a + b for a, b in zip(pipes[0]["param_mb"], pipes[0]["peak_act_mb"])]
            out["mem_per_rank_mb"] = [round(v, 1) for v in per_rank]
            out["mem_single_mb"] = round(one, 1)
            out["mem_ratio"] = round(max(per_rank) / one, 3)
            # Per request served, two ways: token time minus the modules' own forward and
            # backward measured in the same requests (smp's dispatch cost), and token
            # time minus the same work run outside the pipeline (adds the contention of
            # two busy ranks; see reference_work_ms).
            out["request_dispatch_ms"] = [v for p in pipes for v in p["request_dispatch_ms"]
                                          if v is not None]
            out["request_overhead_ms"] = [v for p in pipes for v in p["request_overhead_ms"]
                                          if v is not None]
            out["crossings_per_microbatch"] = pipes[0]["crossings_per_microbatch"]
            out["planned_steps_and_fallbacks"] = pipes[0]["planned_steps_and_fallbacks"]
    simple = pipelined(args.steps, "simple")
    out["peak_act_mb_simple"] = [round(v, 1) for v in simple["peak_act_mb"]]
    # Each schedule smp runs, one run each (the interleaved figure is the rounds' median
    # above), in the default order (each executes its plan: Note [Executed plan]), and
    # the dynamic order where the schedule has one (zero_bubble places its W by plan).
    runs = {"simple": simple, "1f1b": pipelined(args.steps, "1f1b"),
            "zero_bubble": pipelined(args.steps, "zero_bubble")}
    out["smp_schedule_ms"] = {"interleaved": out["smp_ms"],
                              **{k: round(v["ms"], 1) for k, v in runs.items()}}
    out["smp_dynamic_schedule_ms"] = {
        kind: round(pipelined(args.steps, kind, order="dynamic")["ms"], 1)
        for kind in ("interleaved", "simple", "1f1b")}
    # Issue 21's figure: the best step this machine allows (the ceiling above: the
    # slowest rank's own work, optimizer step included, plus one microbatch of fill and
    # drain) over each schedule's step, in the default order.
    out["ceiling_ms"] = round(ceiling_ms, 1)
    out["fraction_of_ceiling"] = {k: round(ceiling_ms / v, 3)
                                  for k, v in out["smp_schedule_ms"].items()}
    # Each side's best schedule, as a user of either would pick it (`ratio` keeps smp's
    # default, "interleaved").
    if out.get("torch_pp_best_ms"):
        best = min(list(out["smp_schedule_ms"].items()) + list(out["smp_dynamic_schedule_ms"].items()),
                   key=lambda kv: kv[1])
        out["smp_best_schedule"] = best[0]
        out["ratio_best_schedules"] = round(best[1] / out["torch_pp_best_ms"], 3)
    # Measured bubble: the share of a step each pp rank's compute token sat idle, mean
    # over the ranks; zero_bubble's against 1F1B's, both executed as planned.
    out["measured_bubble_fraction"] = {
        k: round(1 - statistics.mean(runs[k]["token_busy"]), 3) for k in ("1f1b", "zero_bubble")}
    sys.path.insert(0, os.path.join(BUILD, "python"))
    from smp import _C
    out["plan_bubble_fraction"] = {
        kind: round(_C.Plan(kind, M, S, S + 2).simulate()["bubble_fraction"], 3)
        for kind in ("simple", "interleaved", "1f1b", "zero_bubble")}
    # The plans the runtime executes on this bench's path (the driver holds the first
    # and last stages: 0, 1, 0), with its constraints and costs (Note [Executed plan];
    # the loss accumulates no gradient: Note [Last hop's gradients]).
    path = [0] + [p for s_ in range(1, S) for p in (s_, 0)]
    out["runtime_plan_bubble_fraction"] = {
        kind: round(_C.Plan.executed(kind, M, S, S + 2, path, False)
                    .simulate()["bubble_fraction"], 3)
        for kind in ("simple", "interleaved", "1f1b", "zero_bubble")}
    # pp=2 x dp=2 with ddp: the dp reduction overlapping the pipeline's backward (Note
    # [Pipeline overlap]) against reducing after the step, alternated in one run. Four
    # ranks share two cores here, so this measures the scheduling, not a speedup.
    on, off = [], []
    for _ in range(args.rounds):
        on.append(pipelined(args.steps, "interleaved", TUNED_MALLOC, dp=2)["ms"])
        off.append(pipelined(args.steps, "interleaved", TUNED_MALLOC, dp=2, overlap=False)["ms"])
    out["ppdp_overlap_ms"] = round(statistics.median(on), 1)
    out["ppdp_no_overlap_ms"] = round(statistics.median(off), 1)
    out["ppdp_overlap_ratio"] = round(statistics.median(on) / statistics.median(off), 3)
    out["torch"] = torch.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
