"""Global gradient clipping over every partition of a DistributedModel.

`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` on one rank sees only the
gradients that rank holds (parameters of other partitions have none), so its norm
misses the rest of the model. Here each pp rank sums |g|^p over the parameters it
counts (a tied parameter counts once, on its lowest holder), one allreduce over the pp
group adds the partitions up (MAX for the inf-norm), and every rank scales its
gradients by the same factor. dp replicas hold equal gradients after the reduction, so
they are not summed again (with optimizer-state sharding each dp rank counts the
gradients it keeps, and the sum is over every rank). Same arithmetic as torch 1.13's clip_grad_norm_:
coef = max_norm / (norm + 1e-6), clamped to 1.

Note [torch's clip on the whole model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Training loops (Hugging Face's Trainer, Lightning, most scripts) call
`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`. With partitions > 1 or
optimizer-state sharding that norm is one rank's share only: every rank would clip by
another number, silently. Once a DistributedModel exists, torch's function is wrapped:
called with exactly that model's parameters (every one this rank holds, nothing else)
it computes the global norm here, on every rank as the call is made on every rank;
called with anything else it is torch's.
"""
import math

import torch
import torch.distributed as dist

from smp import core

__all__ = []


def clip_grad_norm_(model, max_norm, norm_type=2.0, error_if_nonfinite=False, grad_of=None):
    """Clips the gradients of every partition of `model` by their global norm.

    Args:
        model: an smp.DistributedModel (partitioned or not).
        max_norm: the largest norm allowed (> 0).
        norm_type: p of the p-norm (a number > 0, or inf).
        error_if_nonfinite: raise if the global norm is nan or inf.
        grad_of: `grad_of(p)`, the gradient to count and clip for parameter `p`
            (default: p.grad; the fp32 master gradients: smp/mixed_precision.py).

    Returns:
        The global norm (a 0-d tensor), the same on every rank.

    Raises:
        ValueError: a bad max_norm or norm_type (on every rank: every rank checks).
        RuntimeError: the norm is not finite and error_if_nonfinite is set.
    """
    try:
        max_norm, norm_type = float(max_norm), float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"smp.clip_grad_norm_: max_norm={max_norm!r} and norm_type="
                         f"{norm_type!r} must be numbers") from None
    if not max_norm > 0 and not math.isinf(max_norm):
        raise ValueError(f"smp.clip_grad_norm_: max_norm={max_norm} is not a number > 0")
    if not norm_type > 0:
        raise ValueError(f"smp.clip_grad_norm_: norm_type={norm_type} is not a number > 0 "
                         "or inf")
    grad_of = grad_of or (lambda p: p.grad)
    params = [p for p in model.local_parameters() if grad_of(p) is not None]
    tied = model.pipeline.tied if model.pipeline is not None else None
    counted = [p for p in params if tied is None or tied.is_counted_here(p)]
    # Note [Sharded optimizer state]: each gradient is kept (or, tied, counted) on one
    # dp rank only: the dp ranks' sums add up too.
    shard = model.replica.shard
    if shard is not None:
        counted = [p for p in counted if shard.owns(p)]
    device = grad_of(params[0]).device if params else torch.device("cpu")
    grads = [grad_of(p).detach() for p in counted]
    if math.isinf(norm_type):
        local = (torch.stack([g.abs().max().to(device) for g in grads]).max() if grads
                 else torch.zeros((), device=device))
    else:
        local = (torch.stack([torch.norm(g, norm_type).to(device) for g in grads])
                 .pow(norm_type).sum() if grads else torch.zeros((), device=device))
    group = (core.get_world_process_group() if shard is not None
             else core.get_pp_process_group() if core.pp_size() > 1 else None)
    if group is not None:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        local = local.float() if local.dtype not in (torch.float32, torch.float64) else local
        dist.all_reduce(local, op=op, group=group)
    total = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"smp.clip_grad_norm_: the total norm of order {norm_type} of the "
                           "gradients is non-finite, so it cannot be clipped")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        g = grad_of(p)
        g.detach().mul_(coef.to(g.device))
    return total


_TORCH_CLIP = None


def redirect_torch_clip():
    """Note [torch's clip on the whole model]: wraps torch.nn.utils.clip_grad_norm_
    (once)."""
    global _TORCH_CLIP
    if _TORCH_CLIP is not None:
        return
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad
    _TORCH_CLIP = clip_grad.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        model = _whole_model(params)
        if model is not None:
            error_if_nonfinite = kwargs.get("error_if_nonfinite", args[0] if args else False)
            return globals()["clip_grad_norm_"](model, max_norm, norm_type, error_if_nonfinite)
        return _TORCH_CLIP(params, max_norm, norm_type, *args, **kwargs)
    clip_grad_norm_.__doc__ = _TORCH_CLIP.__doc__
    clip_grad_norm_.__wrapped__ = _TORCH_CLIP
    clip_grad.clip_grad_norm_ = clip_grad_norm_
    utils.clip_grad_norm_ = clip_grad_norm_


def _whole_model(params):
    """The DistributedModel whose parameters `params` are, if its norm spans more than
    this rank (partitions > 1 or sharded gradients); else None."""
    if not core.is_initialized():
        return None
    model = getattr(core.state, "model", None)
    if model is None or not model.partitioned:
        return None
    if core.pp_size() == 1 and model.replica.shard is None:
        return None
    local = {id(p) for p in model.local_parameters()}
    given = {id(p) for p in params}
    everything = local | {id(p) for p in model.module.parameters()}
    return model if local <= given <= everything else None
