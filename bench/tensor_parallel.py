"""Tensor-parallel benchmark (issue 41): smp's distributed transformer layers against
torch's own tensor parallelism (DTensor), in the same run.

Model: a GPT-2-style stack of LAYERS pre-LN transformer layers (x + attn(LN(x)),
x + mlp(LN(x)), gelu_new, causal self-attention, dropout 0), hidden 512, 8 heads,
intermediate 2048, seq 128, batch BATCH per rank, Adam, loss = MSE to a fixed target.

1. Step time at tp=2 on 2 ranks over Gloo, one intra-op thread per rank, ranks bound to
   their own cores (smprun --bind_cores) on both sides:
   - torch: the same stack as plain modules, `parallelize_module` on a 1-D
     DeviceMesh("cpu", [0, 1]) with ColwiseParallel for query/key/value and dense1,
     RowwiseParallel for the attention's dense and dense2 (Megatron's pairs); both ranks
     feed the same batch (torch TP's convention); torch.optim.Adam over the DTensors,
     the fastest of its foreach/for-loop/fused implementations here (`torch_adam`).
   - smp: `smp.nn.DistributedTransformerLayer`s in smp.DistributedModel, an @smp.step
     doing forward + model.backward(loss), smp.DistributedOptimizer(Adam), config
     {"tensor_parallel_degree": 2, "ddp": true, "prescaled_batch": true}: the same batch
     on both tp ranks, as torch's. `ratio` = smp / torch (target <= 0.8).
   - `smp_unscaled_ms`: smp without prescaled_batch at the same per-rank batch: each
     rank reads its own BATCH rows and the layers gather the tp group's rows, so a step
     trains on 2 x BATCH distinct samples (torch's TP step on BATCH); per sample it is
     `ratio_per_sample_unscaled` = (smp_unscaled_ms / 2) / torch_ms.
   - `floor_ms`: each rank's own slice of the step (its halves of the linears, the whole
     layer norms, forward + backward + the same Adam) with no communication, both ranks
     at once, torch's modules: what neither side can beat on these kernels
     (`torch_over_floor`, `smp_over_floor`: the cost of each side's collectives and
     dispatch; below 1 only when the machine's load swung between the jobs).
   Both sides start from the same full weights (drawn here from seed 0, each rank keeping
   its slice) and the same batch, so their first losses must agree (checked). The jobs
   alternate, `--rounds` of each, so drift of the machine hits both alike; each job
   times `--steps` steps one by one after 3 warm-up steps; the figure is the median step
   of its slower rank, median over the rounds.
2. Memory: each rank's bytes of parameters + Adam state after one step of the smp model
   at tp=1 (1 rank), 2 and 4 (4 ranks on 2 cores; not timed), over tp=1's.
   `mem_ratio` per tp, target <= 1/tp + 5%.

Same allocator setting (smp's default, bench/_malloc.py), threads and data on both sides.
`loadavg`: the machine's 1-minute load at the start and the end (2 cores here; other
work running shifts every figure, and jobs measured a minute apart differ by it).

    PYTHONPATH=build/python SMP_BUILD_DIR=build .venv/bin/python bench/tensor_parallel.py \
        [--rounds 3] [--steps 8]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import _malloc  # bench/_malloc.py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BUILD = os.path.abspath(os.environ.get("SMP_BUILD_DIR", os.path.join(REPO, "build")))
PYTHON = os.environ.get("SMP_PYTHON", sys.executable)  # every side on one torch

LAYERS, HIDDEN, HEADS, INTER, SEQ, BATCH = 4, 512, 8, 2048, 128, 4
HEAD = HIDDEN // HEADS
EPS, INIT_RANGE, LR = 1e-5, 0.02, 1e-4


def full_state(layers=LAYERS):
    """The stack's full weights, drawn from seed 0: every side loads (its slice of)
    these, so both start equal. Names as smp.nn's: `{i}.attention.query.weight`, ..."""
    import torch
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(layers):
        for name, out, inp in (("attention.query", HIDDEN, HIDDEN),
                               ("attention.key", HIDDEN, HIDDEN),
                               ("attention.value", HIDDEN, HIDDEN),
                               ("attention.dense", HIDDEN, HIDDEN),
                               ("output.dense1", INTER, HIDDEN),
                               ("output.dense2", HIDDEN, INTER)):
            sd[f"{i}.{name}.weight"] = torch.randn(out, inp, generator=gen) * INIT_RANGE
            sd[f"{i}.{name}.bias"] = torch.randn(out, generator=gen) * INIT_RANGE
        for name in ("attention.pre_layernorm", "output.pre_layernorm"):
            sd[f"{i}.{name}.weight"] = 1 + torch.randn(HIDDEN, generator=gen) * 0.1
            sd[f"{i}.{name}.bias"] = torch.randn(HIDDEN, generator=gen) * 0.1
    return sd


def batch(seed):
    """(x, mask, target): inputs [BATCH, SEQ, HIDDEN], an additive mask [BATCH,1,1,SEQ]
    (zeros: no padding; the layers are causal) and the loss's target."""
    import torch
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    target = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    return x, torch.zeros(BATCH, 1, 1, SEQ), target


# ---- the torch side -------------------------------------------------------------------

def torch_stack(layers=LAYERS):
    """The reference stack as plain modules, smp.nn's names and semantics."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.query = nn.Linear(HIDDEN, HIDDEN)
            self.key = nn.Linear(HIDDEN, HIDDEN)
            self.value = nn.Linear(HIDDEN, HIDDEN)
            self.dense = nn.Linear(HIDDEN, HIDDEN)
            self.pre_layernorm = nn.LayerNorm(HIDDEN, eps=EPS)

        def forward(self, x, mask):
            n, s, _ = x.shape
            h = self.pre_layernorm(x)
            # Under ColwiseParallel q/k/v are this rank's heads: count them from the shape.
            q, k, v = (m(h).view(n, s, -1, HEAD).transpose(1, 2)
                       for m in (self.query, self.key, self.value))
            causal = torch.full((s, s), float("-inf")).triu(1)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask + causal)
            return x + self.dense(ctx.transpose(1, 2).reshape(n, s, -1))

    class Output(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense1 = nn.Linear(HIDDEN, INTER)
            self.dense2 = nn.Linear(INTER, HIDDEN)
            self.pre_layernorm = nn.LayerNorm(HIDDEN, eps=EPS)

        def forward(self, x):
            return x + self.dense2(F.gelu(self.dense1(self.pre_layernorm(x)),
                                          approximate="tanh"))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = Attention()
            self.output = Output()

        def forward(self, inp):
            x, mask = inp
            return self.output(self.attention(x, mask)), mask

    return nn.Sequential(*[Layer() for _ in range(layers)])


def reference_loss0():
    """The first loss of the unsplit stack in this process (one thread): both sides'
    first step must give it."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    net = torch_stack()
    net.load_state_dict(full_state())
    x, mask, target = batch(0)
    with torch.no_grad():
        return F.mse_loss(net((x, mask))[0], target).item()


def adam(params, kind):
    """torch.optim.Adam, `kind` its implementation. The multi-tensor ones (foreach, fused)
    refuse a group that mixes DTensors (the split linears) and plain tensors (the layer
    norms, which torch TP leaves local): as a torch user would, one param group each."""
    import torch
    extra = {"foreach": {"foreach": True}, "forloop": {"foreach": False},
             "fused": {"fused": True}, "default": {}}[kind]
    params = list(params)
    try:
        from torch.distributed.tensor import DTensor
        groups = [[p for p in params if isinstance(p, DTensor)],
                  [p for p in params if not isinstance(p, DTensor)]]
        params = [{"params": g} for g in groups if g]
    except ImportError:
        pass
    return torch.optim.Adam(params, lr=LR, **extra)


def timed_steps(step, steps, barrier):
    """3 warm-up steps, then `steps` timed one by one: (first loss, [ms])."""
    first = step()
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        barrier()
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    return first, times


def _leave():
    """Ends a torch job once its result is out: every rank meets, then exits without
    tearing torch's Gloo groups down (torch 2.15's DTensor job sometimes aborts in that
    teardown, "terminate called without an active exception", after the timing)."""
    import torch.distributed as dist
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_torch(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:  # torch >= 2.2
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
    except ImportError as exc:
        if rank == 0:
            print("RESULT " + json.dumps({"ms": {}, "loss0": {}, "errors": {
                "all": f"unavailable on torch {torch.__version__}: {exc}"}}))
        return dist.destroy_process_group()
    mesh = DeviceMesh("cpu", list(range(world)))
    plan = {}
    for i in range(LAYERS):
        plan.update({f"{i}.attention.query": ColwiseParallel(),
                     f"{i}.attention.key": ColwiseParallel(),
                     f"{i}.attention.value": ColwiseParallel(),
                     f"{i}.attention.dense": RowwiseParallel(),
                     f"{i}.output.dense1": ColwiseParallel(),
                     f"{i}.output.dense2": RowwiseParallel()})
    out = {"ms": {}, "loss0": {}, "errors": {}}
    for kind in args.adam.split(","):
        net = opt = None
        try:
            net = torch_stack()
            net.load_state_dict(full_state())
            net = parallelize_module(net, mesh, plan)
            opt = adam(net.parameters(), kind)
            x, mask, target = batch(0)  # the same batch on every rank: torch TP's rule

            def step():
                loss = F.mse_loss(net((x, mask))[0], target)
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss.item()

            first, times = timed_steps(step, args.steps, dist.barrier)
            out["ms"][kind] = statistics.median(times)
            out["loss0"][kind] = first
        except Exception as exc:  # an implementation DTensor refuses: reported
            out["errors"][kind] = f"{type(exc).__name__}: {exc}"[:300]
        del net, opt
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        res = {"ms": {k: max(g["ms"][k] for g in gathered) for k in out["ms"]},
               "loss0": out["loss0"], "errors": {}}
        for g in gathered:
            res["errors"].update(g["errors"])
        print("RESULT " + json.dumps(res))
    _leave()


def run_floor(args):
    """Each rank's own share of the tp=2 step with no communication at all: its slice of
    every linear (half the heads, half of dense1's rows, half of dense's and dense2's
    columns), the whole layer norms, forward + backward + Adam, both ranks at once (they
    share the machine as a tp job's do). No tp implementation on these kernels beats it."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    net = torch_stack()
    for layer in net:
        att, mlp = layer.attention, layer.output
        att.query, att.key, att.value = (nn.Linear(HIDDEN, HIDDEN // tp) for _ in range(3))
        att.dense = nn.Linear(HIDDEN // tp, HIDDEN)
        mlp.dense1, mlp.dense2 = nn.Linear(HIDDEN, INTER // tp), nn.Linear(INTER // tp, HIDDEN)
    opt = adam(net.parameters(), args.adam)
    x, mask, target = batch(0)

    def step():
        loss = F.mse_loss(net((x, mask))[0], target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    _, times = timed_steps(step, args.steps, dist.barrier)
    gathered = [None] * tp
    dist.all_gather_object(gathered, statistics.median(times))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"ms": max(gathered)}))
    _leave()


# ---- the smp side ---------------------------------------------------------------------

def smp_stack(layers=LAYERS):
    import torch.nn as nn
    import smp
    return nn.Sequential(*[smp.nn.DistributedTransformerLayer(
        num_attention_heads=HEADS, attention_head_size=HEAD, hidden_size=HIDDEN,
        intermediate_size=INTER, attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
        activation="gelu_new", layernorm_epsilon=EPS, initializer_range=INIT_RANGE,
        use_normal_initialization=True, causal_mask_size=SEQ, pre_layernorm=True,
        post_layernorm=False) for _ in range(layers)])


def load_slices(net, sd):
    """Each parameter takes its tp rank's slice of the full weight (contract: rank t
    holds the t-th contiguous slice along `_smp_tp_dim`); replicated ones the whole."""
    import torch
    import smp
    t, tp = smp.tp_rank(), smp.tp_size()
    own = dict(net.named_parameters())
    missing = sorted(set(sd) - set(own))
    if missing:
        raise RuntimeError(f"smp stack lacks {missing[:4]}")
    with torch.no_grad():
        for name, p in own.items():
            if name not in sd:
                raise RuntimeError(f"no full weight for smp parameter {name}")
            full = sd[name]
            dim = getattr(p, "_smp_tp_dim", None)
            if dim is not None:
                full = full.chunk(tp, dim)[t]
            if tuple(full.shape) != tuple(p.shape):
                raise RuntimeError(f"{name}: slice {tuple(full.shape)} vs {tuple(p.shape)}")
            p.copy_(full)


def smp_setup(cfg, adam_kind):
    import torch
    import torch.nn.functional as F
    import smp
    torch.set_num_threads(1)
    smp.init(cfg)
    torch.manual_seed(0)
    net = smp_stack()
    load_slices(net, full_state())
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(adam(net.parameters(), adam_kind))

    @smp.step
    def train(x, mask, target):
        loss = F.mse_loss(model((x, mask))[0], target)
        model.backward(loss)
        return loss
    # prescaled: the tp ranks share a batch (torch's); else each reads its own.
    x, mask, target = batch(0 if cfg.get("prescaled_batch") else smp.rank())

    def step():
        loss = train(x, mask, target).reduce_mean().item()
        opt.step()
        opt.zero_grad()
        return loss
    return net, model, opt, step


def run_smp(args):
    import smp
    cfg = json.loads(args.config)
    net, model, opt, step = smp_setup(cfg, args.adam)
    first, times = timed_steps(step, args.steps, smp.barrier)
    ms = smp.allgather(statistics.median(times))
    if smp.rank() == 0:
        print("RESULT " + json.dumps({"ms": max(ms), "loss0": first}))


def state_bytes(net, opt):
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    state = sum(v.numel() * v.element_size() for s in opt.state.values()
                for v in s.values() if hasattr(v, "numel"))
    return params, state


def run_mem(args):
    import smp
    cfg = json.loads(args.config)
    net, model, opt, step = smp_setup(cfg, args.adam)
    step()
    params, state = state_bytes(net, opt)
    rows = smp.allgather([params, state])
    if smp.rank() == 0:
        print("RESULT " + json.dumps({"params": [r[0] for r in rows],
                                      "state": [r[1] for r in rows]}))


# ---- the driver -----------------------------------------------------------------------

def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", SMP_PYTHON=PYTHON,
               **_malloc.SMP_DEFAULT)  # Note [Fixed mmap threshold]: both sides
    env["PYTHONPATH"] = os.path.join(BUILD, "python") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def job(nproc, args, bind=True):
    cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", str(nproc)]
    if bind and nproc <= len(os.sched_getaffinity(0)):
        cmd.append("--bind_cores")
    out = subprocess.run(cmd + [__file__] + args, env=_env(), capture_output=True,
                         text=True, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if "RESULT " in ln]
    if out.returncode or not line:
        sys.exit(f"tensor_parallel job {args[:2]} failed:\n{out.stdout[-3000:]}\n"
                 f"{out.stderr[-3000:]}")
    return json.loads(line[0].split("RESULT ", 1)[1])


def smp_cfg(tp, prescaled=True, **extra):
    cfg = {"tensor_parallel_degree": tp, "ddp": True}
    if prescaled:
        cfg["prescaled_batch"] = True
    return json.dumps(dict(cfg, **extra))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["bench", "torch", "floor", "smp", "mem"],
                        default="bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--config", default="{}")
    parser.add_argument("--adam", default="foreach,forloop,fused",
                        help="torch side: Adam implementations to time (the best counts)")
    parser.add_argument("--only", choices=["all", "torch", "time", "mem"], default="all")
    args = parser.parse_args()
    if args.role == "torch":
        return run_torch(args)
    if args.role == "floor":
        return run_floor(args)
    if args.role == "smp":
        return run_smp(args)
    if args.role == "mem":
        return run_mem(args)
    import torch
    steps = ["--steps", str(args.steps)]
    load0 = os.getloadavg()[0]  # other work on the machine skews every figure alike
    out = {"bench": "tensor_parallel", "tp": 2, "layers": LAYERS, "hidden": HIDDEN,
           "heads": HEADS, "intermediate": INTER, "seq": SEQ, "batch_per_rank": BATCH}
    if args.only in ("all", "torch", "time"):
        torch_runs, floor_runs, smp_runs, unscaled_runs = [], [], [], []
        adam_kinds = args.adam
        for r in range(args.rounds):  # alternate, so drift of the machine hits all alike
            torch_runs.append(job(2, ["--role", "torch", "--adam", adam_kinds] + steps))
            if r == 0 and "," in adam_kinds and torch_runs[0]["ms"]:
                # the later rounds time only the implementation that won the first
                adam_kinds = min(torch_runs[0]["ms"], key=torch_runs[0]["ms"].get)
            floor_runs.append(job(2, ["--role", "floor", "--adam", adam_kinds] + steps))
            if args.only == "torch":
                continue
            # The same Adam implementation as torch's best (plain tensors: one group).
            smp_args = ["--role", "smp", "--adam", adam_kinds] + steps
            smp_runs.append(job(2, smp_args + ["--config", smp_cfg(2)]))
            unscaled_runs.append(job(2, smp_args + ["--config", smp_cfg(2, prescaled=False)]))
        if not torch_runs[0]["ms"]:  # no torch TP here (or every Adam failed): say so
            sys.exit(f"torch tensor parallelism failed: {torch_runs[0]['errors']}")
        best = min(torch_runs[0]["ms"], key=torch_runs[0]["ms"].get)
        ref = reference_loss0()  # the unsplit stack's first loss: torch TP must give it
        if not math.isclose(torch_runs[0]["loss0"][best], ref, rel_tol=1e-4):
            sys.exit(f"first loss: torch TP {torch_runs[0]['loss0'][best]} vs unsplit {ref}")
        torch_ms = statistics.median(t["ms"][best] for t in torch_runs)
        out.update({"torch_ms": round(torch_ms, 1), "torch_adam": best,
                    "torch_adam_ms": {k: round(v, 1) for k, v in torch_runs[0]["ms"].items()},
                    "torch_loss0": torch_runs[0]["loss0"][best]})
        floor_ms = statistics.median(f["ms"] for f in floor_runs)
        out.update({"floor_ms": round(floor_ms, 1),
                    "torch_over_floor": round(torch_ms / floor_ms, 3)})
        if torch_runs[0]["errors"]:
            out["torch_errors"] = torch_runs[0]["errors"]
        if smp_runs:
            smp_ms = statistics.median(s["ms"] for s in smp_runs)
            unscaled_ms = statistics.median(s["ms"] for s in unscaled_runs)
            if not math.isclose(smp_runs[0]["loss0"], out["torch_loss0"], rel_tol=1e-4):
                sys.exit(f"first loss: smp {smp_runs[0]['loss0']} vs torch "
                         f"{out['torch_loss0']}")
            out.update({"smp_ms": round(smp_ms, 1), "ratio": round(smp_ms / torch_ms, 3),
                        "smp_loss0": smp_runs[0]["loss0"],
                        "smp_over_floor": round(smp_ms / floor_ms, 3),
                        "smp_unscaled_ms": round(unscaled_ms, 1),
                        "ratio_unscaled": round(unscaled_ms / torch_ms, 3),
                        "ratio_per_sample_unscaled": round(unscaled_ms / 2 / torch_ms, 3)})
    if args.only in ("all", "mem"):
        mem = {tp: job(tp, ["--role", "mem", "--adam", "foreach", "--config", smp_cfg(tp)],
                       bind=False) for tp in (1, 2, 4)}
        one = mem[1]["params"][0] + mem[1]["state"][0]
        out["mem_mb_tp1"] = round(one / 2**20, 2)
        for tp in (2, 4):
            per_rank = [p + s for p, s in zip(mem[tp]["params"], mem[tp]["state"])]
            out[f"mem_mb_tp{tp}"] = [round(b / 2**20, 2) for b in per_rank]
            out[f"mem_ratio_tp{tp}"] = round(max(per_rank) / one, 4)
            out[f"mem_target_tp{tp}"] = round(1 / tp + 0.05, 4)
    out["loadavg"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    out["torch"] = torch.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
