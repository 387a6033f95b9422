"""Pipeline benchmark: 8x (Linear(768,768)+GELU) + head, batch 256, one thread per rank.

smp with pp=2, microbatches=8 ("interleaved", and "simple" for memory) against the same
model trained in one process (whole batch), measured alternately in the same run. Prints
one JSON line: ms/step of both, the speedup, the GPipe bound S*M/(S+M-1), the peak
activation memory per rank for both schedules, and this machine's parallel efficiency
(one process alone vs two at once: the ceiling any 2-rank speedup here is bound by).

    PYTHONPATH=build/python /usr/bin/python3 bench/pipeline.py [--rounds 3] [--steps 8]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BUILD = os.environ.get("SMP_BUILD_DIR", os.path.join(REPO, "build"))
PYTHON = os.environ.get("SMP_PYTHON", "/usr/bin/python3")
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


def run_single(steps):
    import torch
    import torch.nn as nn
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = build_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    tracker = ActivationTracker(net.parameters())

    def step():
        with tracker.context():
            loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    first = step()
    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - start) / steps * 1e3
    print(json.dumps({"ms": ms, "loss0": first, "peak_act_mb": tracker.peak / 2**20}))


def run_pipeline(steps):
    import torch
    import torch.nn as nn
    import smp
    from smp import pipeline
    torch.set_num_threads(1)
    smp.init()
    torch.manual_seed(0)
    net = build_model()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01))
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))

    @smp.step
    def train(x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    first = train(x, y).reduce_mean().item()  # includes trace + partition
    tracker = ActivationTracker(list(model.local_parameters()))
    pipeline.Engine.task_context = tracker.context
    opt.step()
    opt.zero_grad()
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
    peaks = smp.allgather(tracker.peak / 2**20)
    if smp.rank() == 0:
        print("RESULT " + json.dumps({"ms": ms, "loss0": first, "peak_act_mb": peaks}))


def _python_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = os.path.join(BUILD, "python") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def single(steps):
    out = subprocess.run([PYTHON, __file__, "--role", "single", "--steps", str(steps)],
                         env=_python_env(), capture_output=True, text=True, timeout=600)
    if out.returncode:
        sys.exit(f"single-process run failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pipelined(steps, schedule):
    cfg = {"partitions": S, "microbatches": M, "pipeline": schedule}
    cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", str(S), "--config",
           json.dumps(cfg), __file__, "--role", "pp", "--steps", str(steps)]
    out = subprocess.run(cmd, env=_python_env(), capture_output=True, text=True, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if "RESULT " in ln]
    if out.returncode or not line:
        sys.exit(f"pipeline run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[0].split("RESULT ", 1)[1])


def parallel_efficiency(steps):
    """One single-process run alone vs two at once: how much 2 busy cores slow each."""
    alone = single(steps)["ms"]
    env = _python_env()
    procs = [subprocess.Popen([PYTHON, __file__, "--role", "single", "--steps", str(steps)],
                              env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    both = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1])["ms"]
            for p in procs]
    return alone / statistics.mean(both)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["bench", "single", "pp"], default="bench")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.role == "single":
        return run_single(args.steps)
    if args.role == "pp":
        return run_pipeline(args.steps)
    import torch
    singles, pipes = [], []
    for _ in range(args.rounds):  # alternate, so drift of the machine hits both alike
        singles.append(single(args.steps))
        pipes.append(pipelined(args.steps, "interleaved"))
    simple = pipelined(args.steps, "simple")
    # Same seed, same first batch: the first losses agree (a correctness check).
    if abs(singles[0]["loss0"] - pipes[0]["loss0"]) > 1e-4:
        sys.exit(f"loss mismatch: single {singles[0]['loss0']} vs smp {pipes[0]['loss0']}")
    single_ms = statistics.median(s["ms"] for s in singles)
    smp_ms = statistics.median(p["ms"] for p in pipes)
    print(json.dumps({
        "bench": "pipeline", "pp": S, "microbatches": M, "batch": BATCH,
        "smp_ms": round(smp_ms, 1), "single_ms": round(single_ms, 1),
        "speedup": round(single_ms / smp_ms, 3), "ratio": round(smp_ms / single_ms, 3),
        "gpipe_bound": round(S * M / (S + M - 1), 3),
        "machine_parallel_efficiency": round(parallel_efficiency(args.steps), 3),
        "peak_act_mb_interleaved": [round(v, 1) for v in pipes[0]["peak_act_mb"]],
        "peak_act_mb_simple": [round(v, 1) for v in simple["peak_act_mb"]],
        "peak_act_mb_single": round(singles[0]["peak_act_mb"], 1),
        "torch": torch.__version__}))


if __name__ == "__main__":
    main()
