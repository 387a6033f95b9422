"""Global gradient clipping over every partition of a DistributedModel.

`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` on one rank sees only the
gradients that rank holds (parameters of other partitions have none), so its norm
misses the rest of the model. Here each pp rank sums |g|^p over the parameters it
counts (a tied parameter counts once, on its lowest holder), one allreduce over the pp
group adds the partitions up (MAX for the inf-norm), and every rank scales its
gradients by the same factor. dp replicas hold equal gradients after the reduction, so
they are not summed again (with optimizer-state sharding each dp rank counts the
gradients it keeps, and the sum is over every rank). Under tensor parallelism (Note
[Norm over tp slices]) the sum is over the mp group (pp x tp). Same arithmetic as torch 1.13's clip_grad_norm_:
coef = max_norm / (norm + 1e-6), clamped to 1. `global_norm` is that norm, for
clip_grad_norm_ and for smp.optimizers.FusedLamb's clipping (Note [LAMB's global
norm] in smp/optimizers.py).

Note [torch's clip on the whole model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Training loops (Hugging Face's Trainer, Lightning, most scripts) call
`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`. With partitions > 1 or
optimizer-state sharding that norm is one rank's share only: every rank would clip by
another number, silently. Once a DistributedModel exists, torch's function is wrapped:
called with exactly that model's parameters (every one this rank holds, nothing else)
it computes the global norm here, on every rank as the call is made on every rank;
called with anything else it is torch's.

Note [Norm over tp slices]
~~~~~~~~~~~~~~~~~~~~~~~~~~
With tensor_parallel_degree > 1 a distributed parameter (`_smp_tp_dim`) is a different
slice on each tp rank of a stage, and a replicated one the same tensor on each (the
reducer made their gradients equal, Note [Slices reduce over their rdp group] in
smp_core/detail/reducer_build.cpp). The global norm counts every slice once and every
replicated gradient once: each tp rank counts its slices, only tp rank 0 counts the
replicated gradients, and the sum is over the mp group (pp x tp), the stage's tp ranks
and the partitions at once.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as clip_grad

from smp.groups import gradient_span_group
from smp.process_state import is_initialized, state
from smp.ranks import tp_rank, tp_size

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
    total = global_norm(model, params, norm_type, grad_of=grad_of)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"smp.clip_grad_norm_: the total norm of order {norm_type} of the "
                           "gradients is non-finite, so it cannot be clipped")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        g = grad_of(p)
        g.detach().mul_(coef.to(g.device))
    return total


def counted(model, params, grad_of=None):
    """Those of `params` whose gradient (`grad_of(p)`, default p.grad) this rank counts
    in `model`'s global gradient norm: each that has one, a tied parameter on its lowest
    holder only, and with sharded optimizer state only those this rank keeps."""
    grad_of = grad_of or (lambda p: p.grad)
    tied = model.pipeline.tied if model.pipeline is not None else None
    counted = [p for p in params
               if grad_of(p) is not None and (tied is None or tied.is_counted_here(p))]
    # Note [Sharded optimizer state]: each gradient is kept (or, tied, counted) on one
    # dp rank only: the dp ranks' sums add up too.
    shard = model.replica.shard
    if shard is not None:
        counted = [p for p in counted if shard.owns(p)]
    elif tp_size() > 1 and tp_rank() > 0:  # Note [Norm over tp slices]
        counted = [p for p in counted if hasattr(p, "_smp_tp_dim")]
    return counted


def _torch_local(grads, norm_type):
    """sum |g|^p over `grads` (max |g| for the inf-norm): a 0-d tensor."""
    device = grads[0].device if grads else torch.device("cpu")
    if math.isinf(norm_type):
        return (torch.stack([g.abs().max().to(device) for g in grads]).max() if grads
                else torch.zeros((), device=device))
    return (torch.stack([torch.norm(g, norm_type).to(device) for g in grads])
            .pow(norm_type).sum() if grads else torch.zeros((), device=device))


def global_norm(model, params, norm_type=2.0, local=_torch_local, grad_of=None):
    """The `norm_type`-norm of the gradients of `params` over every rank of `model`,
    the same 0-d tensor on every rank. Each rank sums its counted(model, params) by
    `local(grads, norm_type)` (sum |g|^p, or max |g| for inf, a 0-d tensor); one
    all_reduce adds the ranks up: over the world with sharded optimizer state, over the
    mp group (pp x tp; Note [Norm over tp slices]) at partitions > 1 or
    tensor_parallel_degree > 1 (collective there: every rank of the group calls it).
    dp replicas hold equal gradients after the reduction, so unsharded they are not
    summed again.

    Args:
        grad_of: `grad_of(p)`, the gradient of `p` to count (default p.grad).
    """
    grad_of = grad_of or (lambda p: p.grad)
    first = next((g for g in map(grad_of, params) if g is not None), None)
    device = first.device if first is not None else torch.device("cpu")
    grads = [grad_of(p).detach() for p in counted(model, params, grad_of)]
    total = local(grads, norm_type).to(device)
    # Note [Norm over tp slices]: the mp group is the pp group when tp = 1.
    group = gradient_span_group(model.replica.shard is not None)
    if group is not None:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        total = total.float() if total.dtype not in (torch.float32, torch.float64) else total
        dist.all_reduce(total, op=op, group=group)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def spanning_model():
    """The DistributedModel whose gradients span more than this rank (partitioned, with
    partitions > 1, tensor_parallel_degree > 1 or sharded optimizer state), or None."""
    if not is_initialized():
        return None
    model = getattr(state, "model", None)
    if model is None or not model.partitioned:
        return None
    if gradient_span_group(model.replica.shard is not None) is None:
        return None
    return model


_TORCH_CLIP = None


def redirect_torch_clip():
    """Note [torch's clip on the whole model]: wraps torch.nn.utils.clip_grad_norm_
    (once)."""
    global _TORCH_CLIP
    if _TORCH_CLIP is not None:
        return
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
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_


def _whole_model(params):
    """The DistributedModel whose parameters `params` are, if its norm spans more than
    this rank (partitions > 1 or sharded gradients); else None."""
    model = spanning_model()
    if model is None:
        return None
    local = {id(p) for p in model.local_parameters()}
    given = {id(p) for p in params}
    everything = local | {id(p) for p in model.module.parameters()}
    return model if local <= given <= everything else None
