"""Quantizing hooks (torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks).

Each rank quantizes its bucket to uint8 with its own scale and zero point (torch's
MinMaxObserver, or PerChannelMinMaxObserver on channels of `bucket_size` elements),
the ranks allgather the uint8 tensors (4x fewer bytes than float32, but an allgather:
world_size parts arrive), and each dequantizes and averages them. The arithmetic is
torch's; unlike torch's hooks, these run on CPU as well as CUDA, and they issue the
second allgather from the comm thread, never from a completion callback
(hooks/quantization_hooks.h).
"""
import smp._C as _C
from smp.ddp_comm_hooks._builtin import run

__all__ = ["quantization_pertensor_hook", "quantization_perchannel_hook"]


def quantization_pertensor_hook(process_group, bucket):
    """Averages `bucket` over `process_group`, sent as uint8 with one scale and zero
    point per rank; returns a Future of the float32 mean."""
    return run(quantization_pertensor_hook, process_group, bucket)


def quantization_perchannel_hook(process_group, bucket, bucket_size=512):
    """As quantization_pertensor_hook, with a scale and zero point per channel of
    `bucket_size` elements (the bucket zero-padded to whole channels).

    Raises:
        smp.ConfigError: bucket_size < 1.
    """
    return run(quantization_perchannel_hook, process_group, bucket, bucket_size)


quantization_pertensor_hook._smp_builtin = _C.quantization_pertensor_hook
quantization_perchannel_hook._smp_builtin = _C.quantization_perchannel_hook
