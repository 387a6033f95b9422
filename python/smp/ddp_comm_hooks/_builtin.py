"""How smp's built-in hooks run: natively on smp's reducer, or under torch's DDP.

Each public built-in is a Python function with torch's signature `(state, bucket)` that
carries the C++ hook (`smp._C.BuiltinHook`) as `_smp_builtin`. `model.register_comm_hook`
installs that C++ object on smp's reducer (no Python per bucket). Called by torch's
`DistributedDataParallel` with torch's GradBucket, the function hands the bucket to C++,
which queues the hook's collectives on the group's ordered queue and returns a torch
Future (Note [Built-in hooks under torch DDP] in python/csrc/bind_reducer.cpp).
"""
import torch.distributed as dist

import smp._C as _C

__all__ = []


def native_of(hook):
    """The C++ hook behind `hook`, or None for a plain Python callable."""
    return getattr(hook, "_smp_builtin", None)


def group_of(state):
    """The process group a built-in's `state` names (a group, or a state's
    `process_group`), or None."""
    if state is None:
        return None
    if isinstance(state, dist.ProcessGroup):
        return state
    return getattr(state, "process_group", None)


def run(hook, state, bucket, channel_size=512):
    """Runs the built-in `hook` (a function carrying `_smp_builtin`) on `bucket`.

    On smp's GradBucket it runs the C++ hook directly. On torch's GradBucket (torch's
    DDP) a state without a group means torch's default (world) group, as for torch's
    own hooks.
    """
    native = native_of(hook)
    if isinstance(bucket, _C.GradBucket):
        return native(state, bucket, channel_size)
    default = dist.distributed_c10d._get_default_group()
    queue = group_of(state) or default
    return _C.run_on_torch_bucket(native, state, bucket, default, queue, channel_size)


class CompressWrapper:
    """What fp16_compress_wrapper(hook) / bf16_compress_wrapper(hook) return: a hook
    `(state, bucket)` that runs `hook` on a compressed copy of the bucket. Pickles as
    the wrapper of the same hook, by the wrapper's name (so that pickles keep loading if
    `_C.BuiltinCommHookType` grows).

    `kind`: a wrapper's `_C.BuiltinCommHookType`, or its name (what pickles hold)."""

    def __init__(self, kind, hook):
        kind = kind if isinstance(kind, _C.BuiltinCommHookType) else \
            _C.BuiltinCommHookType.from_hook_name(kind)
        if not kind.is_wrapper:
            raise ValueError(f"smp: CompressWrapper({kind.hook_name!r}): not a wrapper")
        if not callable(hook):
            raise ValueError(f"smp: {kind.hook_name}(hook={hook!r}): hook is not callable")
        self._kind = kind.hook_name
        self._inner = hook
        inner = native_of(hook) or hook
        self._smp_builtin = _C.BuiltinHook(kind, inner)
        name = getattr(hook, "__name__", type(hook).__name__)
        self.__name__ = self.__qualname__ = f"{kind}_hook"
        self._inner_name = name

    def __call__(self, state, bucket):
        return run(self, state, bucket)

    def __reduce__(self):
        return CompressWrapper, (self._kind, self._inner)

    def __eq__(self, other):
        return isinstance(other, CompressWrapper) and (self._kind, self._inner) == (
            other._kind, other._inner)

    def __hash__(self):
        return hash((self._kind, self._inner))

    def __repr__(self):
        return f"<smp {self._kind} of {self._inner_name}>"
