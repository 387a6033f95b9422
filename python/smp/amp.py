"""Mixed precision helpers: `smp.amp.GradScaler` (SMP v1 name).

Note [One found_inf for the pipeline]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's GradScaler decides alone, on each rank, whether the gradients it unscales
hold an inf. With partitions > 1 each rank holds one stage's gradients, so one stage
could skip a step that another takes, and from then on their scales differ (every
gradient a stage receives is scaled by the driver's scale and unscaled by its own),
silently. So once a model spans ranks (partitions > 1, or optimizer-state sharding,
where each dp rank keeps only its share of the gradients) every GradScaler's
`found_inf` of an smp step is the job's: the step's finish agrees on it in C++ (Note
[One overflow decision] in smp_core/loss_scale.cpp), and torch's `_unscale_grads_`
(used by torch.amp.GradScaler and smp.amp.GradScaler alike) reports it on every
device it unscaled. Every rank then skips the same steps and moves its scale the same
way. The first step that meets a scaler nobody announced (torch's, made before smp
saw it) decides on the main thread, where every rank makes the same call.
"""
import warnings

import torch

from smp import mixed_precision
from smp.process_state import is_initialized, state
from smp.ranks import pp_size

__all__ = ["GradScaler"]


# torch >= 2.3 has the device-generic torch.amp.GradScaler(device, ...) and deprecates
# torch.cuda.amp.GradScaler (a FutureWarning on every construction); 1.13 has only the latter.
_TORCH_AMP = hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler")
_Base = torch.amp.GradScaler if _TORCH_AMP else torch.cuda.amp.GradScaler


class GradScaler(_Base):
    """torch's GradScaler (`scale`, `unscale_`, `step`, `update`, `state_dict`), whose
    `found_inf` is agreed across every rank holding part of the model (Note [One
    found_inf for the pipeline]). On CPU it scales too (torch 2.x's
    `torch.amp.GradScaler("cpu")`); with torch 1.13, which has no CPU scaler, it is a
    pass-through there."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True, device=None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if enabled and mixed_precision.model_dtype() == torch.float16:
            # Config fp16 keeps fp16 gradients, which torch's scaler refuses to unscale;
            # there the loss scale is smp.DistributedOptimizer's (SMP v1.10).
            warnings.warn("smp.amp.GradScaler: config 'fp16'=true scales the loss in "
                          "smp.DistributedOptimizer (static_loss_scale, dynamic_loss_scale); "
                          "this GradScaler passes through", stacklevel=2)
            enabled = False
        if _TORCH_AMP:
            super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval,
                             enabled=enabled)
        else:
            super().__init__(init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval,
                             enabled=enabled and device == "cuda")
        if self.is_enabled():
            mixed_precision.want_overflow_check()

    def unscale_(self, optimizer):
        # A pp rank other than the driver runs no step body after the first step, so
        # it may meet unscale_ with no scale() made here: start from the same scale.
        if self.is_enabled() and getattr(self, "_scale", None) is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            device = params[0].device if params else torch.device(getattr(self, "_device", "cpu"))
            self._lazy_init_scale_growth_tracker(device)
        return super().unscale_(optimizer)


def _spans_ranks(optimizer):
    """Whether `optimizer` steps part of an smp model whose gradients span ranks."""
    if not is_initialized() or not hasattr(optimizer, "_smp_orig_step"):
        return False
    model = getattr(state, "model", None)
    if model is None or not model.partitioned:
        return False
    return pp_size() > 1 or model.replica.shard is not None


_OWN_UNSCALE = None


def agree_found_inf():
    """Note [One found_inf for the pipeline]: wraps torch's GradScaler._unscale_grads_
    (once)."""
    global _OWN_UNSCALE
    if _OWN_UNSCALE is not None or not _TORCH_AMP:
        return
    _OWN_UNSCALE = _Base._unscale_grads_

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = _OWN_UNSCALE(self, optimizer, inv_scale, found_inf, allow_fp16)
        if not _spans_ranks(optimizer):
            return per_device
        mixed_precision.want_overflow_check()
        agreed = mixed_precision.found_overflow()
        if not per_device:  # this rank unscaled nothing: it still reports the job's answer
            per_device[found_inf.device] = torch.zeros_like(found_inf)
        if agreed:
            for v in per_device.values():
                v.fill_(1.0)
        return per_device
    _unscale_grads_.__wrapped__ = _OWN_UNSCALE
    _Base._unscale_grads_ = _unscale_grads_


agree_found_inf()
