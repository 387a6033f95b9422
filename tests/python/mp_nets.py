"""The model and the one-process references of tests/python/test_mixed_precision.py
(imported by its rank scripts and by the test itself).

TiedNet: an embedding on pp rank 0 whose weight the head on pp rank 1 reuses (a tied
pair: its gradient sums over both), a LayerNorm, and Linear layers on both stages.
The references implement, independently of smp, what issue 38 asks for: an fp16 (or
bf16) model with fp32 master weights, the loss scaled by a dynamic loss scaler with
Megatron's rules, an overflowing step skipped, and the master gradients clipped by
their global norm.
"""
import contextlib

import torch
import torch.nn as nn

VOCAB, WIDTH, CTX = 16, 32, 6
PER, MB = 4, 2            # rows per dp rank per step, microbatches
INF_PARAM = "fc2.weight"  # on pp rank 1


class TiedNet(nn.Module):
    def __init__(self, part=None):
        super().__init__()
        part = part or (lambda i: contextlib.nullcontext())
        with part(0):
            self.emb = nn.Embedding(VOCAB, WIDTH)
            self.fc1 = nn.Linear(WIDTH, WIDTH)
        with part(1):
            self.fc2 = nn.Linear(WIDTH, WIDTH)
            self.ln = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = torch.relu(self.fc1(self.emb(x)))
        h = self.ln(torch.relu(self.fc2(h)))
        return self.head(h)


def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def batch(step, dp_size):
    g = torch.Generator().manual_seed(500 + step)
    data = torch.randint(0, VOCAB, (PER * dp_size, CTX + 1), generator=g)
    return data[:, :-1], data[:, 1:]


class Scaler:
    """Megatron's dynamic loss scaler, written from its documented rules."""

    def __init__(self, init_scale, scale_factor=2.0, scale_window=1000, min_scale=1.0,
                 delayed_shift=1, consecutive_hysteresis=False):
        self.scale, self.factor, self.window = init_scale, scale_factor, scale_window
        self.min, self.shift, self.consecutive = min_scale, delayed_shift, consecutive_hysteresis
        self.hysteresis, self.iter, self.last = delayed_shift, 0, -1

    def update(self, overflow):
        if overflow:
            if self.shift == 1 or self.hysteresis == 1:
                self.scale = max(self.scale / self.factor, self.min)
            else:
                self.hysteresis -= 1
            self.last = self.iter
        else:
            if self.consecutive:
                self.hysteresis = self.shift
            if (self.iter - self.last) % self.window == 0:
                if not self.consecutive:
                    self.hysteresis = self.shift
                self.scale *= self.factor
        self.iter += 1


def reference(opts):
    """One process: the half model, fp32 masters, the scaler, the same data and the same
    injected inf. Returns {losses, scales, overflows, norms, state (the model's
    state dict as lists), masters (by parameter name)}."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: half-precision kernels split sums by thread
    try:
        return _reference(opts)
    finally:
        torch.set_num_threads(threads)


def _reference(opts):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[opts["dtype"]]
    dp = opts["dp"]
    torch.manual_seed(0)
    net = TiedNet().to(dtype)
    names = [n for n, _ in net.named_parameters()]
    params = [p for _, p in net.named_parameters()]
    masters = [nn.Parameter(p.detach().float().clone()) for p in params]
    opt = torch.optim.SGD(masters, lr=opts["lr"], momentum=0.9)
    scaler = Scaler(**opts["scaler"]) if opts["dtype"] == "fp16" else None
    inject = {"step": opts.get("inf_step", -1)}
    cur = {"step": -1}
    hook_param = dict(net.named_parameters())[INF_PARAM]
    hook_param.register_hook(lambda g: g * float("inf") if cur["step"] == inject["step"]
                             and cur["mb"] == 0 else g)
    out = dict(losses=[], scales=[], overflows=[], norms=[])
    for step in range(opts["steps"]):
        cur["step"] = step
        x, y = batch(step, dp)
        scale = scaler.scale if scaler else 1.0
        losses = []
        for r in range(dp):
            xs, ys = x[r * PER:(r + 1) * PER], y[r * PER:(r + 1) * PER]
            for mb, (xm, ym) in enumerate(zip(xs.chunk(MB), ys.chunk(MB))):
                cur["mb"] = mb if r == 0 else 1  # injected on dp rank 0 only
                loss = loss_fn(net(xm), ym)
                losses.append(loss.item())
                (loss / (MB * dp) * scale).backward()
        out["losses"].append(sum(losses) / len(losses))
        overflow = bool(scaler) and any(not torch.isfinite(p.grad.float()).all()
                                        for p in params if p.grad is not None)
        if not overflow:
            for p, m in zip(params, masters):
                m.grad = p.grad.float() / scale
            if opts.get("clip"):
                out["norms"].append(torch.nn.utils.clip_grad_norm_(masters, opts["clip"]).item())
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        elif opts.get("clip"):
            out["norms"].append(-1)
        if scaler:
            scaler.update(overflow)
        out["scales"].append(scaler.scale if scaler else 1.0)
        out["overflows"].append(overflow)
        net.zero_grad()
        for m in masters:
            m.grad = None
    out["state"] = {k: v.float().tolist() for k, v in net.state_dict().items()}
    out["masters"] = {n: m.tolist() for n, m in zip(names, masters)}
    return out
