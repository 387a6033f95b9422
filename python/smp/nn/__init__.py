"""`smp.nn`: modules SMP v1 provides: the tensor-parallel distributed modules (SMP
v1.6+, docs/tensor_parallel.md) and apex's FusedLayerNorm."""
import torch

from smp import tp_substitution
from smp.nn.layer_norm import FusedLayerNorm
from smp.nn.distributed import DistributedEmbedding, DistributedLinear, DistributedModule
from smp.nn.transformer import (DistributedAttentionLayer, DistributedTransformer,
                                DistributedTransformerLayer, DistributedTransformerLMHead,
                                DistributedTransformerOutputLayer)

__all__ = ["FusedLayerNorm", "DistributedModule", "DistributedLinear", "DistributedEmbedding",
           "DistributedAttentionLayer", "DistributedTransformerOutputLayer",
           "DistributedTransformerLayer", "DistributedTransformer",
           "DistributedTransformerLMHead"]


def _linear_init_hook(in_features, out_features, bias=True, device=None, dtype=None):
    return (in_features, out_features), {"bias": bias}


def _register_torch(registry, register_fn, Registration):
    """Built-in registration (SMP v1.10): an nn.Linear created where tensor parallelism
    is enabled becomes a DistributedLinear holding its weights' slice (Note
    [Substitution] in smp/tp_substitution.py)."""
    if torch.nn.Linear not in registry:
        register_fn(Registration(
            torch.nn.Linear, DistributedLinear, _linear_init_hook, None, None,
            values=lambda m: dict(m.state_dict()),
            recover_args=lambda m: ((m.in_features, m.out_features),
                                    {"bias": m.bias is not None}),
            builtin=True))


tp_substitution.add_builtin_provider(_register_torch)
