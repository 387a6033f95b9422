"""Unreduced gradients under ddp: a gradient that reaches a parameter outside smp's
backward is never reduced across the replicas, which then drift apart silently.

Note [Unreduced gradients]: with ddp and more than one replica, each of the model's
parameters gets a hook on its gradient accumulator (torch's AccumulateGrad node, the
node DDP hooks too, so `torch.autograd.grad` and gradients of non-leaf tensors do not
fire it). A gradient is expected only while smp runs a backward:
- inside `model.backward()` (any microbatch's, on any thread);
- on a pipeline rank other than the driver (pp rank > 0), while it serves a step: its
  backward work is the driver's `model.backward()` reaching it.
Anything else is `loss.backward()` (inside or outside `@smp.step`) or
`torch.autograd.backward` on the model's outputs, and raises UnreducedGradientError
from inside that backward, before the optimizer can apply the gradient. Every rank of
a ddp job runs the same code, so every rank raises. Cost: one Python call per
parameter per backward (a counter and a bool read).
"""
import threading

import torch

from smp import core

__all__ = []


class UnreducedGradientError(RuntimeError):
    """A gradient reached a parameter outside model.backward() under ddp."""


class GradGuard:
    """Hooks the gradient accumulators of `named_params` (name, Parameter) of a model.

    The guard is a context manager around smp's own backward; `in_step()` (whether the
    model is inside a step) and the rank's pp position tell the rest (Note [Unreduced
    gradients]).
    """

    def __init__(self, in_step, named_params):
        self._in_step = in_step
        self._depth = 0
        self._lock = threading.Lock()
        self._nodes = []  # AccumulateGrad nodes: the tensor holds its node weakly
        self._handles = []
        with torch.enable_grad():
            for name, p in named_params:
                if not p.requires_grad:
                    continue
                node = p.view_as(p).grad_fn.next_functions[0][0]
                self._nodes.append(node)
                self._handles.append(node.register_hook(self._make_hook(name)))

    def _make_hook(self, name):
        def hook(_grad_inputs, _grad_outputs):
            if self._depth == 0 and not self._serving():
                self._raise(name)
        return hook

    def _serving(self):
        return self._in_step() and core.pp_size() > 1 and core.pp_rank() > 0

    def _raise(self, name):
        dp = core.dp_size()
        if self._in_step():
            what = ("inside an @smp.step function by loss.backward() (or "
                    "torch.autograd.backward)")
            fix = "call model.backward(loss) there instead of loss.backward()"
        else:
            what = "outside @smp.step (by loss.backward() or torch.autograd.backward)"
            fix = ("run the forward and the backward inside an @smp.step function and "
                   "call model.backward(loss) there")
        raise UnreducedGradientError(
            f"smp: the gradient of parameter '{name}' was computed {what}; with 'ddp': "
            f"true it would not be reduced across the {dp} model replicas, which would "
            f"drift apart. To fix: {fix} (rank {core.rank()})")

    def __enter__(self):
        """`with guard:` around smp's own backward: gradients arriving inside are smp's."""
        with self._lock:
            self._depth += 1

    def __exit__(self, *exc):
        with self._lock:
            self._depth -= 1
        return False

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles, self._nodes = [], []
