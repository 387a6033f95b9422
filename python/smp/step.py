"""`@smp.step`: splits a batch into microbatches, runs the step body on each, and
collects per-microbatch results into `StepOutput`s.

Splitting rules (SMP v1): every tensor argument is split along its split axis (0, or
`input_split_axes[name]`), tensors inside lists, tuples and dicts too; objects with
`smp_slice(num_mb, mb, axis)` split themselves; `non_split_inputs` names arguments
passed whole to every microbatch; other values are passed as they are.
"""
import functools
import inspect

import torch

from smp import auto_resume, ranks
from smp._C import ConfigError
from smp.checkpoint import resume_from_checkpoint
from smp.checkpoint._async import at_step_end as settle_finished_saves
from smp.collectives import STEP_CALL, api_call
from smp.nested import same_sequence
from smp.process_state import require_init, state

__all__ = []


class StepOutput:
    """Per-microbatch values of one output of a step function.

    Attributes:
        outputs: list with one entry per microbatch.
    """

    def __init__(self, outputs):
        self.outputs = list(outputs)

    def reduce_mean(self):
        """Mean over microbatches (of the per-microbatch values)."""
        return torch.mean(torch.stack([torch.as_tensor(o) for o in self.outputs]), dim=0)

    def reduce_sum(self):
        return torch.sum(torch.stack([torch.as_tensor(o) for o in self.outputs]), dim=0)

    def concat(self):
        """Concatenates along the batch axis (0); 0-d values are stacked."""
        if self.outputs and torch.as_tensor(self.outputs[0]).dim() == 0:
            return self.stack()
        return torch.cat([torch.as_tensor(o) for o in self.outputs], dim=0)

    def stack(self):
        return torch.stack([torch.as_tensor(o) for o in self.outputs], dim=0)

    def __len__(self):
        return len(self.outputs)

    def __repr__(self):
        return f"StepOutput({self.outputs!r})"


def _split_tensor(t, num_mb, axis, where):
    if t.dim() == 0:
        return [t] * num_mb  # scalars go whole to every microbatch
    if axis >= t.dim() or axis < -t.dim():
        raise ConfigError(f"smp.step: input {where} has {t.dim()} dims; split axis {axis} is "
                         f"out of range (set input_split_axes)")
    size = t.size(axis)
    if size == 0:
        raise ConfigError(f"smp.step: input {where} has size 0 along axis {axis} "
                               f"(shape {list(t.shape)}); a batch must hold at least "
                               f"microbatches={num_mb} samples")
    if size < num_mb:
        raise ConfigError(f"smp.step: input {where} has batch size {size} along axis "
                               f"{axis}, smaller than microbatches={num_mb} (allowed: a "
                               f"multiple of {num_mb})")
    if size % num_mb != 0:  # ConfigError on every step, not only the first one's agreement
        raise ConfigError(f"smp.step: input {where} has size {size} along axis {axis}, not "
                         f"divisible by microbatches={num_mb} (allowed: a multiple of "
                         f"{num_mb}, or list it in non_split_inputs)")
    return list(torch.chunk(t, num_mb, dim=axis))


def split_value(value, num_mb, axis, where):
    """Returns `num_mb` pieces of `value` following the splitting rules."""
    if isinstance(value, torch.Tensor):
        return _split_tensor(value, num_mb, axis, where)
    if hasattr(value, "smp_slice"):
        return [value.smp_slice(num_mb, mb, axis) for mb in range(num_mb)]
    if isinstance(value, (list, tuple)):
        parts = [split_value(v, num_mb, axis, f"{where}[{i}]") for i, v in enumerate(value)]
        return [same_sequence(value, [p[mb] for p in parts]) for mb in range(num_mb)]
    if isinstance(value, dict):
        parts = {k: split_value(v, num_mb, axis, f"{where}[{k!r}]") for k, v in value.items()}
        return [type(value)((k, parts[k][mb]) for k in value) for mb in range(num_mb)]
    return [value] * num_mb


def split_arguments(fn_signature, args, kwargs, num_mb, non_split_inputs, input_split_axes):
    """Splits a step's arguments into `num_mb` (args, kwargs) pairs."""
    bound = fn_signature.bind(*args, **kwargs)
    names = list(bound.arguments)
    non_split = set(non_split_inputs or ())
    axes = dict(input_split_axes or {})
    for name in list(non_split) + list(axes):
        if name not in fn_signature.parameters:
            raise ValueError(f"smp.step: input '{name}' named in non_split_inputs/"
                             f"input_split_axes is not a parameter of the step function "
                             f"(allowed: {', '.join(fn_signature.parameters)})")
    pieces = {}
    for name in names:
        value = bound.arguments[name]
        if name in non_split:
            pieces[name] = [value] * num_mb
        else:
            pieces[name] = split_value(value, num_mb, axes.get(name, 0), f"'{name}'")
    result = []
    for mb in range(num_mb):
        b = inspect.BoundArguments(fn_signature, {n: pieces[n][mb] for n in names})
        result.append((b.args, b.kwargs))
    return result


def collect_outputs(per_mb, detach):
    """Turns a list of per-microbatch return values into the step's return value.

    Tensors become a StepOutput each (containers are kept); other values become a
    per-microbatch list.
    """
    first = per_mb[0]
    if isinstance(first, torch.Tensor):
        return StepOutput([o.detach() if detach else o for o in per_mb])
    if isinstance(first, (list, tuple)) and not isinstance(first, str):
        return same_sequence(first, [collect_outputs([o[i] for o in per_mb], detach)
                                     for i in range(len(first))])
    if isinstance(first, dict):
        return type(first)((k, collect_outputs([o[k] for o in per_mb], detach)) for k in first)
    if first is None:
        return None
    return list(per_mb)


def step(fn=None, *, non_split_inputs=None, input_split_axes=None, detach_outputs=True):
    """Decorates a training/evaluation step; works bare (`@smp.step`) and called.

    Args:
        non_split_inputs: names of arguments passed whole to every microbatch.
        input_split_axes: {argument name: axis} for arguments not split along axis 0.
        detach_outputs: detach returned tensors from the graph (default True).

    Raises:
        ValueError: an input cannot be split into `microbatches` equal parts.
    """
    if fn is None:
        return functools.partial(step, non_split_inputs=non_split_inputs,
                                 input_split_axes=input_split_axes,
                                 detach_outputs=detach_outputs)
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        require_init()
        model = state.model
        if model is None:
            raise RuntimeError("smp.step: no smp.DistributedModel exists; wrap the model "
                               "before calling a step function")
        pending = auto_resume.take_pending()  # Note [Automatic resume]
        if pending is not None:
            resume_from_checkpoint(pending["dir"], tag=pending["tag"],
                                   partial=pending["partial"])
            auto_resume.restore_hook_state()
        skip, skipped = auto_resume.before_step()
        if skip:  # fast-forwarded (Note [Automatic resume])
            return None if skipped is None else collect_outputs(skipped, True)
        num_mb = state.cfg.microbatches
        try:
            mb_inputs = split_arguments(sig, args, kwargs, num_mb, non_split_inputs,
                                        input_split_axes)
            input_error = None
        except ValueError as exc:
            if ranks.size() == 1:
                raise
            # Raised on every rank that shares the step, not only here (a pp rank other
            # than the driver does not use its inputs: it serves the driver's step).
            mb_inputs, input_error = None, exc
        # Names the first step's agreement collectives in errors (Note [Naming the call]).
        with api_call(STEP_CALL):
            per_mb = model._run_step(fn, mb_inputs, input_error)
        auto_resume.after_step(per_mb)
        settle_finished_saves()  # Note [Asynchronous save] in smp/checkpoint/_async.py
        return collect_outputs(per_mb, detach_outputs)

    wrapper.smp_step = True
    return wrapper
