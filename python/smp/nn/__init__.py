"""`smp.nn`: modules SMP v1 provides in place of other libraries' (apex's
FusedLayerNorm)."""
from smp.nn.layer_norm import FusedLayerNorm

__all__ = ["FusedLayerNorm"]
