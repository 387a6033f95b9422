"""`smp.nn.FusedLayerNorm`: apex's FusedLayerNorm without apex (SMP v1 name)."""
import torch

__all__ = []


class FusedLayerNorm(torch.nn.LayerNorm):
    """Layer normalization (Ba et al. 2016, arXiv:1607.06450) with the signature of
    `apex.normalization.FusedLayerNorm`: over the last len(normalized_shape)
    dimensions, y = (x - E[x]) / sqrt(Var[x] + eps) * weight + bias, with `weight`
    (ones) and `bias` (zeros) of `normalized_shape` when `elementwise_affine`.

    It is torch's nn.LayerNorm, and that is apex's functionality: apex's fused CUDA
    kernel computes this same function (biased variance, eps inside the root) with the
    same parameters under the same names, and apex itself falls back to
    torch.nn.functional.layer_norm for tensors off the GPU; torch's layer_norm is one
    fused kernel on CPU and GPU. So outputs, gradients and state dicts (`weight`,
    `bias`) are nn.LayerNorm's: a state dict loads into nn.LayerNorm (or apex's
    module) and back, and under autocast it runs as nn.LayerNorm does (in fp32 where
    torch's autocast lists layer_norm so).

    Args:
        normalized_shape: an int or the trailing shape to normalize over.
        eps: added to the variance.
        elementwise_affine: learnable per-element weight and bias.
        memory_efficient: accepted for apex's signature (apex recomputes from the
            output in backward); torch's layer_norm saves its input as usual, so it
            changes nothing computed.
        device, dtype: of the parameters (torch's factory arguments).
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 memory_efficient=False, *, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine,
                         device=device, dtype=dtype)
        self.memory_efficient = bool(memory_efficient)
