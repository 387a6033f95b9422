"""`smp.nn`: modules SMP v1 provides: the tensor-parallel distributed modules (SMP
v1.6+, docs/tensor_parallel.md) and apex's FusedLayerNorm."""
from smp.nn.layer_norm import FusedLayerNorm
from smp.nn.distributed import DistributedEmbedding, DistributedLinear, DistributedModule
from smp.nn.transformer import (DistributedAttentionLayer, DistributedTransformer,
                                DistributedTransformerLayer, DistributedTransformerLMHead,
                                DistributedTransformerOutputLayer)

__all__ = ["FusedLayerNorm", "DistributedModule", "DistributedLinear", "DistributedEmbedding",
           "DistributedAttentionLayer", "DistributedTransformerOutputLayer",
           "DistributedTransformerLayer", "DistributedTransformer",
           "DistributedTransformerLMHead"]
