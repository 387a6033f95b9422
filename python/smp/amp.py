"""Mixed precision helpers: `smp.amp.GradScaler` (SMP v1 name).

On CPU there is nothing to scale, so the scaler passes through (scale() returns the
loss, step() calls optimizer.step()); with CUDA it is torch's GradScaler.
"""
import torch

__all__ = ["GradScaler"]


class GradScaler(torch.cuda.amp.GradScaler):
    """torch's GradScaler; disabled (a pass-through) when CUDA is unavailable."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True):
        super().__init__(init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled and torch.cuda.is_available())
