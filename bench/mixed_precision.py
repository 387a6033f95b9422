"""Mixed-precision benchmarks (issue 38): one JSON line with a key per section.

Each section is a function `bench_<name>(args) -> dict` listed in SECTIONS; `--sections`
picks some (default: all). A section checks its result, warms up, then times smp and
its torch peer in the same process, alternating, with the same threads, and reports
medians and ratios (smp / torch).

- pipeline: bench/_mp_pipeline.py (the pp=2 step in bf16/fp16 against fp32 and against
  one process under the same rules).
- optimizers: one step of smp.optimizers.FusedLamb and FusedNovoGrad (fp32) against
  torch's fastest AdamW on CPU, measured here: `fused=True` where torch has it on CPU
  (2.4+), `foreach=True`, the faster of the two. Model: ~100M parameters as 8 blocks
  of a transformer layer's Linears at width 1024 (4 of 1024x1024, 1024x4096,
  4096x1024, with biases); gradients random (no backward). LAMB's step includes its
  global-norm clipping (apex's max_grad_norm=1.0), which AdamW's does not: the line
  also gives AdamW + torch.nn.utils.clip_grad_norm_, the same work as LAMB does.
  Checked: every parameter finite after the steps, and LAMB's closed form ||p' - p|| =
  lr ||p|| (the trust ratio) on one tensor.
  What bounds it, where memory bandwidth bounds AdamW (a CPU): per fp32 parameter
  AdamW moves 28 bytes (reads g, p, m, v; writes p, m, v), NovoGrad 24 (its norm pass
  reads g, its update reads g, p, m and writes p, m), LAMB 44 (the global norm reads g;
  the first pass reads g, p, m, v and writes m, v and the update; the second reads p
  and the update and writes p: Note [LAMB step] in smp_core/optim/lamb.cpp), AdamW with
  torch's clip_grad_norm_ 40. So LAMB's step costs at least ~1.6 AdamW's alone.

    PYTHONPATH=build/python .venv/bin/python bench/mixed_precision.py [--rounds 10]
        [--threads N] [--sections optimizers pipeline]
"""
import argparse
import json
import statistics
import sys
import time

import torch

WIDTH, BLOCKS = 1024, 8


def _model():
    layers = []
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)]
        layers += [torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)]
    return torch.nn.Sequential(*layers)


def _adamw(params, kind):
    """torch's AdamW with fused=True or foreach=True, or None where this torch has no
    such CPU step."""
    try:
        opt = torch.optim.AdamW(params, lr=1e-3, **{kind: True})
        opt.step()  # fused=True may only refuse CPU tensors at the first step
        return opt
    except (RuntimeError, TypeError, ValueError):
        return None


def _time(fn):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def bench_optimizers(args):
    from smp.optimizers import FusedLamb, FusedNovoGrad
    torch.manual_seed(0)
    params = list(_model().parameters())
    numel = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)

    # Check: LAMB's update of a tensor with weight decay is lr * ||p|| long.
    lamb = FusedLamb(params, lr=1e-3, weight_decay=0.01)
    probe = params[0]
    before = probe.detach().clone()
    lamb.step()
    moved = float((probe.detach() - before).double().norm())
    want = 1e-3 * float(before.double().norm())
    assert abs(moved - want) <= 1e-4 * want, (moved, want)
    novograd = FusedNovoGrad(params, lr=1e-3, weight_decay=0.01)

    peers = {kind: _adamw(params, kind) for kind in ("fused", "foreach")}
    peers = {k: v for k, v in peers.items() if v is not None}
    steps = {"lamb": lamb.step, "novograd": novograd.step}
    steps.update({f"adamw_{k}": v.step for k, v in peers.items()})

    def adamw_clip(opt):
        # torch's clip (foreach) multiplies every gradient by min(1, max/norm): with a
        # max above the norm the gradients stay as they are, round after round.
        torch.nn.utils.clip_grad_norm_(params, 1e30)
        opt.step()

    for name, step in list(steps.items()):
        step()  # warm-up: state allocated, pages touched
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name].append(_time(step))
    ms = {name: statistics.median(t) for name, t in times.items()}
    best = min((k for k in ms if k.startswith("adamw_")), key=ms.get)
    clip = [_time(lambda: adamw_clip(peers[best[len("adamw_"):]])) for _ in range(args.rounds)]
    assert all(torch.isfinite(p).all() for p in params), "a step made a parameter non-finite"
    out = {
        "params_m": round(numel / 1e6, 1),
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "lamb_ms": round(ms["lamb"], 1),
        "novograd_ms": round(ms["novograd"], 1),
        "torch_adamw": best[len("adamw_"):],
        "torch_ms": round(ms[best], 1),
        "torch_adamw_clip_ms": round(statistics.median(clip), 1),
        "lamb_ratio": round(ms["lamb"] / ms[best], 3),
        "novograd_ratio": round(ms["novograd"] / ms[best], 3),
        "lamb_vs_adamw_clip_ratio": round(ms["lamb"] / statistics.median(clip), 3),
    }
    for k in peers:
        out[f"torch_adamw_{k}_ms"] = round(ms[f"adamw_{k}"], 1)
    return out


def bench_pipeline(args):
    """pipeline: the pp=2 step in bf16 and fp16 against fp32, and smp's fp16 pipeline step
    against the same model trained plainly in one process under the same rules
    (bench/_mp_pipeline.py: its processes are started here, one thread per rank)."""
    import _mp_pipeline  # bench/
    return _mp_pipeline.bench_pipeline(rounds=max(1, min(args.rounds, 3)), steps=10)


SECTIONS = {"optimizers": bench_optimizers, "pipeline": bench_pipeline}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    line = {"bench": "mixed_precision", "torch": torch.__version__}
    for name in args.sections:
        line[name] = SECTIONS[name](args)
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
