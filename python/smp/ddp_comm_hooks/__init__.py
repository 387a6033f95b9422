"""Gradient communication hooks (the paths of torch.distributed.algorithms.ddp_comm_hooks).

The built-ins are C++ hooks behind Python functions with torch's signature
`hook(state, bucket)`: `model.register_comm_hook` runs the C++ hook on the reducer's
comm thread with no Python on the hot path, and torch's DistributedDataParallel can
register them too (smp/ddp_comm_hooks/_builtin.py). Any Python callable
`hook(state, bucket) -> torch.futures.Future[Tensor]` works as well, torch's own hooks
included; on an smp model a state without a group reduces over the dp group (Note
[Comm hooks reduce over the dp group] in _groups.py).
"""
from enum import Enum
from functools import partial

import torch.distributed as dist

from smp.ddp_comm_hooks import (
    debugging_hooks, default_hooks, post_localSGD_hook, powerSGD_hook, quantization_hooks,
)
from smp.ddp_comm_hooks._builtin import native_of
from smp.ddp_comm_hooks import _safe

_safe.register()  # Note [Hook state loads weights-only]

__all__ = ["DDPCommHookType", "register_ddp_comm_hook", "default_hooks", "debugging_hooks",
           "powerSGD_hook", "quantization_hooks", "post_localSGD_hook"]


def _register(comm_hook, model, state):
    model.register_comm_hook(state, comm_hook)


def _register_powerSGD(comm_hook, model, state, matrix_approximation_rank,
                       start_powerSGD_iter=1_000):
    # As torch: `state` is only the process group; the PowerSGD state is made here.
    psgd_state = powerSGD_hook.PowerSGDState(
        process_group=state, matrix_approximation_rank=matrix_approximation_rank,
        start_powerSGD_iter=start_powerSGD_iter)
    model.register_comm_hook(psgd_state, comm_hook)


class DDPCommHookType(Enum):
    """The built-in hooks by name (torch's DDPCommHookType), each a registration call:
    `DDPCommHookType.ALLREDUCE.value(model=model, state=process_group)`."""

    ALLREDUCE = partial(_register, comm_hook=default_hooks.allreduce_hook)
    FP16_COMPRESS = partial(_register, comm_hook=default_hooks.fp16_compress_hook)
    BF16_COMPRESS = partial(_register, comm_hook=default_hooks.bf16_compress_hook)
    QUANTIZE_PER_TENSOR = partial(
        _register, comm_hook=quantization_hooks.quantization_pertensor_hook)
    QUANTIZE_PER_CHANNEL = partial(
        _register, comm_hook=quantization_hooks.quantization_perchannel_hook)
    POWER_SGD = partial(_register_powerSGD, comm_hook=powerSGD_hook.powerSGD_hook,
                        matrix_approximation_rank=1)
    POWER_SGD_RANK2 = partial(_register_powerSGD, comm_hook=powerSGD_hook.powerSGD_hook,
                              matrix_approximation_rank=2)
    BATCHED_POWER_SGD = partial(_register_powerSGD,
                                comm_hook=powerSGD_hook.batched_powerSGD_hook,
                                matrix_approximation_rank=1)
    BATCHED_POWER_SGD_RANK2 = partial(_register_powerSGD,
                                      comm_hook=powerSGD_hook.batched_powerSGD_hook,
                                      matrix_approximation_rank=2)
    NOOP = partial(_register, comm_hook=debugging_hooks.noop_hook)


def register_ddp_comm_hook(comm_hook_type, model, state=None):
    """Registers the built-in `comm_hook_type` on `model` (an smp.DistributedModel or
    torch's DistributedDataParallel) with `state` (a process group or None).

    Raises:
        ValueError: comm_hook_type is not a DDPCommHookType.
    """
    if not isinstance(comm_hook_type, DDPCommHookType):
        raise ValueError(f"smp: register_ddp_comm_hook comm_hook_type={comm_hook_type!r} is "
                         f"not one of {{{', '.join(t.name for t in DDPCommHookType)}}}")
    comm_hook_type.value(model=model, state=state)


def _between_hosts(reducer, state):
    """Note [Hooks between hosts] (smp_core/detail/host_links.cpp): where the reducer
    reduces hierarchically, the hook runs on each host's first rank over the group of
    those ranks, so its state gets that group (None on a host's other ranks, which never
    run it) in place of the dp group it was resolved to."""
    if not reducer.hierarchy():
        return state
    hosts = reducer.hosts_group
    if state is None or isinstance(state, dist.ProcessGroup):
        return hosts
    if hasattr(state, "process_group"):
        state.process_group = hosts
    return state


def _install(reducer, state, hook):
    """Registers `hook` with `state` on a C++ reducer (a built-in's C++ hook, or the
    Python callable), and gives the first step torch DDP's constructor buckets, so the
    hook sees the bucket layouts torch's DDP would show it (Note [Hook buckets follow
    torch's] in smp_core/detail/reducer_rebuild.cpp)."""
    state = _between_hosts(reducer, state)
    reducer.register_comm_hook(state, native_of(hook) or hook)
    # Note [Hook state carries its layout] (powerSGD_hook.py): a loaded state brings the
    # buckets it is indexed by.
    take = getattr(state, "_smp_take_layout", None)
    layout = take() if take is not None else None
    if layout is not None:
        reducer.adopt_layout(layout)
    else:
        reducer.use_torch_initial_layout()
    attach = getattr(state, "_smp_attach", None)
    if attach is not None:
        attach(reducer)
