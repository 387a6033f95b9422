"""Mixed precision helpers: `smp.amp.GradScaler` (SMP v1 name).

On CPU there is nothing to scale, so the scaler passes through (scale() returns the
loss, step() calls optimizer.step()); with CUDA it is torch's GradScaler.
"""
import torch

__all__ = ["GradScaler"]


# torch >= 2.3 has the device-generic torch.amp.GradScaler(device, ...) and deprecates
# torch.cuda.amp.GradScaler (a FutureWarning on every construction); 1.13 has only the latter.
_TORCH_AMP = hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler")
_Base = torch.amp.GradScaler if _TORCH_AMP else torch.cuda.amp.GradScaler


class GradScaler(_Base):
    """torch's GradScaler for CUDA; disabled (a pass-through) when CUDA is unavailable."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True):
        device = ("cuda",) if _TORCH_AMP else ()
        super().__init__(*device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled and torch.cuda.is_available())
