"""Stateless hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks).

`process_group` is the group to reduce over. Registered on an smp model, None (or a
group with the dp group's members) means the model's dp group; any other group is
refused at registration. Under torch's DistributedDataParallel, None means torch's
default group, as with torch's own hooks.

- allreduce_hook: averages the bucket over the group (divides first, then sums).
- fp16_compress_hook / bf16_compress_hook: the same on a float16 / bfloat16 copy.
- fp16_compress_wrapper(hook) / bf16_compress_wrapper(hook): run `hook` on a
  compressed copy of the bucket and decompress its result.

Each is a C++ hook (see smp/ddp_comm_hooks/_builtin.py): results are bit-identical to
torch's hooks on the same inputs.
"""
import smp._C as _C
from smp.ddp_comm_hooks._builtin import CompressWrapper, run

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "fp16_compress_wrapper", "bf16_compress_wrapper"]


def allreduce_hook(process_group, bucket):
    """Averages `bucket` over `process_group`; returns a Future of the bucket."""
    return run(allreduce_hook, process_group, bucket)


def fp16_compress_hook(process_group, bucket):
    """Averages `bucket` over `process_group` in float16; returns a Future of the
    result in the bucket's dtype."""
    return run(fp16_compress_hook, process_group, bucket)


def bf16_compress_hook(process_group, bucket):
    """Averages `bucket` over `process_group` in bfloat16."""
    return run(bf16_compress_hook, process_group, bucket)


allreduce_hook._smp_builtin = _C.allreduce_hook
fp16_compress_hook._smp_builtin = _C.fp16_compress_hook
bf16_compress_hook._smp_builtin = _C.bf16_compress_hook


def fp16_compress_wrapper(hook):
    """`hook` run on a float16 copy of the bucket, its result cast back.

    Args:
        hook: a hook `(state, bucket)`: a built-in or any Python callable.

    Raises:
        ValueError: `hook` is not callable.
    """
    return CompressWrapper(_C.BuiltinCommHookType.FP16_COMPRESS_WRAPPER, hook)


def bf16_compress_wrapper(hook):
    """`hook` run on a bfloat16 copy of the bucket (see fp16_compress_wrapper)."""
    return CompressWrapper(_C.BuiltinCommHookType.BF16_COMPRESS_WRAPPER, hook)
