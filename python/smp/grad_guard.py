"""Unreduced gradients under ddp: a gradient that reaches a parameter outside smp's
backward is never reduced across the replicas, which then drift apart silently.

The guard itself is C++ (Note [Unreduced gradients] in smp_core/grad_guard.cpp): a post
hook on each parameter's gradient accumulator, which reads two flags, so a backward
(served in C++ on a pipeline rank, or run by torch on a task thread) takes no GIL for
it. A gradient is expected only inside `model.backward()` (`with guard:`) or, on a pipeline
rank that serves the driver's requests (pp rank > 0), while the model is inside a step
(`guard.in_step`). Anything else is `loss.backward()` (inside or outside `@smp.step`) or
`torch.autograd.backward` on the model's outputs, and raises UnreducedGradientError from
inside that backward, before the optimizer can apply the gradient. This module keeps
the error's text.
"""
import smp._C as _C
from smp.process_state import state
from smp.ranks import dp_size, pp_rank, pp_size, rank

__all__ = []


class UnreducedGradientError(RuntimeError):
    """A gradient reached a parameter outside model.backward() under ddp."""


def _raise(name, in_step):
    """Raises the error of parameter `name`'s unguarded gradient (the C++ hook's call)."""
    raise UnreducedGradientError(_text(f"the gradient of parameter '{name}' was computed",
                                       in_step))


def _text(what_happened, in_step):
    dp, pp = dp_size(), pp_size()
    if in_step:
        what = ("inside an @smp.step function by loss.backward() (or "
                "torch.autograd.backward)")
        fix = "call model.backward(loss) there instead of loss.backward()"
    else:
        what = "outside @smp.step (by loss.backward() or torch.autograd.backward)"
        fix = ("run the forward and the backward inside an @smp.step function and "
               "call model.backward(loss) there")
    why = []
    if pp > 1:
        why.append(f"with partitions={pp} only model.backward() runs the backward across "
                   "the pipeline stages")
    if state.model is not None and state.model.replica.reduces:
        why.append(f"with 'ddp': true it would not be reduced across the {dp} model "
                   "replicas, which would drift apart")
    return (f"smp: {what_happened} {what}; {' and '.join(why)}. To fix: {fix} "
            f"(rank {rank()})")


def backward_in_trace(*_args, **_kwargs):
    """Tensor.backward and torch.autograd.backward while the first step is traced with
    partitions > 1 (smp/model_pipeline.py): the trace runs the forward only, so the
    autograd error would say nothing of the cause."""
    raise UnreducedGradientError(_text("a backward was started", True))


class GradGuard:
    """Hooks the gradient accumulators of `named_params` (name, Parameter) of a model.

    A context manager around smp's own backward; `in_step` says whether the model is
    inside a step (the model sets it as its step begins and ends).
    """

    def __init__(self, named_params):
        serving = pp_size() > 1 and pp_rank() > 0
        self._guard = _C.GradGuard(list(named_params), serving, _raise)

    @property
    def in_step(self):
        return self._guard.in_step

    @in_step.setter
    def in_step(self, value):
        self._guard.in_step = bool(value)

    def __enter__(self):
        """`with guard:` around smp's own backward: gradients arriving inside are smp's."""
        self._guard.enter()

    def __exit__(self, *exc):
        self._guard.exit()
        return False

    def remove(self):
        self._guard.remove()
