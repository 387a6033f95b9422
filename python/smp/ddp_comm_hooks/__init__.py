"""Gradient communication hooks (the paths of torch.distributed.algorithms.ddp_comm_hooks).

The built-ins are C++ (`smp._C.BuiltinHook` objects): `model.register_comm_hook` runs
them on the reducer's comm thread with no Python on the hot path. Any Python callable
`hook(state, bucket) -> torch.futures.Future[Tensor]` works too.
"""
from smp.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook

__all__ = ["default_hooks", "debugging_hooks", "powerSGD_hook"]


def _install(reducer, state, hook):
    """Registers `hook` with `state` on a C++ reducer (built-in or Python callable)."""
    reducer.register_comm_hook(state, hook)
