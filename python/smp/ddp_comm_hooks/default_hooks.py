"""Stateless hooks; `state` is the process group to reduce over, or None (the dp group).

- allreduce_hook: averages the bucket over the group (divides first, then sums).
- fp16_compress_hook / bf16_compress_hook: the same on a float16 / bfloat16 copy.
- fp16_compress_wrapper(hook) / bf16_compress_wrapper(hook): run `hook` on a
  compressed copy of the bucket and decompress its result.
"""
from smp import _C

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "fp16_compress_wrapper", "bf16_compress_wrapper"]

allreduce_hook = _C.allreduce_hook
fp16_compress_hook = _C.fp16_compress_hook
bf16_compress_hook = _C.bf16_compress_hook
fp16_compress_wrapper = _C.fp16_compress_wrapper
bf16_compress_wrapper = _C.bf16_compress_wrapper
