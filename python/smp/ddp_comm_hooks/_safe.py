"""Note [Hook state loads weights-only]: torch >= 2.6's `torch.load` unpickles with its
weights-only unpickler by default, which refuses any global it was not told is safe.
smp's comm hooks and the hook states that pickle as plain data are registered here with
`torch.serialization.add_safe_globals`, once, when smp's hooks are imported: a checkpoint
holding them (the DDP docs' example with smp's names, `smp.save` of a hook and its state)
loads with the default `torch.load` and with `smp.load(..., weights_only=True)`. Each
entry rebuilds only itself from plain data: a hook is a module-level function, found by
name; `CompressWrapper` is called with a wrapper name it checks and the hook it wraps;
`PowerSGDState.__setstate__` validates its options and restores numbers, lists and
tensors (Note [Hook state loads weights-only] in powerSGD_hook.py). torch's own
`PowerSGDState` still holds a numpy RandomState and stays refused, as torch refuses it.
Not here: `PostLocalSGDState`, whose process groups do not pickle at all.
"""
import torch.serialization as _ser

from smp.ddp_comm_hooks import (
    debugging_hooks, default_hooks, powerSGD_hook, quantization_hooks, post_localSGD_hook,
)
from smp.ddp_comm_hooks._builtin import CompressWrapper

__all__ = []

SAFE_GLOBALS = (
    powerSGD_hook.PowerSGDState, powerSGD_hook.powerSGD_hook,
    powerSGD_hook.batched_powerSGD_hook,
    default_hooks.allreduce_hook, default_hooks.fp16_compress_hook,
    default_hooks.bf16_compress_hook, default_hooks.fp16_compress_wrapper,
    default_hooks.bf16_compress_wrapper, CompressWrapper,
    quantization_hooks.quantization_pertensor_hook,
    quantization_hooks.quantization_perchannel_hook,
    debugging_hooks.noop_hook, post_localSGD_hook.post_localSGD_hook,
)


def register():
    """Allows SAFE_GLOBALS in torch's weights-only unpickler (torch >= 2.4 has the list;
    older torch has no weights-only default to satisfy)."""
    add = getattr(_ser, "add_safe_globals", None)
    if add is not None:
        add(list(SAFE_GLOBALS))
