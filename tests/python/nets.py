"""Small models shared by the rank scripts of several tests (tests/python is on the
ranks' PYTHONPATH, see conftest.rank_env)."""
import contextlib

import torch
import torch.nn as nn

__all__ = ["Net", "Nested", "gpt_job", "reset_peak", "state_digest", "status_mb", "train_gpt"]


class Net(nn.Module):
    """Four Linear layers (8 -> 32 -> 32 -> 32 -> 4): enough parameters for several
    gradient buckets at a small bucket_cap_mb, and 32x32 matrices PowerSGD compresses."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        return self.head(torch.relu(self.fc3(h)))


def gpt_job(smp, gpt_class, cfg, dropout=0.2, deferred=False):
    """smp.init(cfg with 4 microbatches), then examples/gpt_checkpoint.py's GPT from seed 0
    with every Dropout at `dropout`, wrapped, with AdamW: (model, optimizer). `deferred`:
    built inside smp.delay_param_initialization."""
    smp.init(dict(cfg, microbatches=4))
    torch.manual_seed(0)
    with smp.delay_param_initialization(enabled=deferred):
        net = gpt_class()
    for m in net.modules():
        if isinstance(m, nn.Dropout):
            m.p = dropout
    model = smp.DistributedModel(net)
    return model, smp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=3e-3))


def train_gpt(smp, model, opt, vocab, ctx, steps=3, per=8):
    """`steps` optimizer steps of a GPT-style `model` (examples/gpt_checkpoint.py) on
    seeded token data, `per` sequences per dp rank; returns the losses and a SHA-256 of
    every parameter (the full state on every rank), for comparing runs for equality."""
    loss_fn = nn.functional.cross_entropy

    @smp.step
    def train_step(x, y):
        loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        model.backward(loss)
        return loss

    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        data = torch.randint(0, vocab, (per * smp.dp_size(), ctx + 1), generator=g)
        x, y = data[:, :-1], data[:, 1:]
        lo = smp.dp_rank() * per
        losses.append(train_step(x[lo:lo + per], y[lo:lo + per]).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    return losses, state_digest(model.state_dict())


def state_digest(state):
    """A SHA-256 of a state dict's names and values (for comparing runs for equality)."""
    import hashlib
    digest = hashlib.sha256()
    for k in sorted(state):
        digest.update(k.encode())
        digest.update(state[k].detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


class Nested(nn.Module):
    """The root on pp rank 0 calls `outer` (pp rank 1), whose forward calls `inner` and
    `kept_fp32` back on pp rank 0, the latter under `autocast(enabled=False)`: nested
    requests that pp rank 0 serves on the task thread waiting for `outer`, which runs
    under autocast itself when the step does."""

    def __init__(self, partition=None):
        super().__init__()
        place = partition or (lambda _: contextlib.nullcontext())
        with place(1):
            self.outer = _Outer(place)
        with place(0):
            self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.outer(x))

    @staticmethod
    def batch(i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


class _Outer(nn.Module):
    def __init__(self, place):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        with place(0):
            self.inner = nn.Linear(8, 8)
            self.kept_fp32 = nn.Linear(8, 8)

    def forward(self, x):
        h = self.inner(self.lin(x))
        with torch.autocast("cpu", enabled=False):
            return self.kept_fp32(h.float()) + h


def status_mb(field):
    """This process's /proc/self/status `field` in MB: VmRSS (resident now) or VmHWM (the
    peak since the last reset_peak())."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024


def reset_peak():
    """Resets VmHWM to the resident size now (Linux clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
