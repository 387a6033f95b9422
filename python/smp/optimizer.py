"""`smp.DistributedOptimizer`: returns the user's optimizer itself, with the SMP v1
state methods added, so it stays a torch.optim.Optimizer (LR schedulers keep working)
and keeps the Parameter objects it was built on.
"""
import types

from smp import core

__all__ = []


def _local_state_dict(self):
    sd = self._smp_orig_state_dict()
    sd["_smp_is_partial"] = core.pp_size() > 1
    return sd


def _state_dict(self):
    return self._smp_orig_state_dict()


def _load_state_dict(self, state_dict):
    state_dict = dict(state_dict)
    state_dict.pop("_smp_is_partial", None)
    return self._smp_orig_load_state_dict(state_dict)


def DistributedOptimizer(optimizer):  # noqa: N802  (SMP v1 name)
    """Adds `local_state_dict()` and partial-aware `state_dict`/`load_state_dict`.

    Args:
        optimizer: a torch.optim.Optimizer built on the model's parameters.

    Returns:
        The same optimizer object.
    """
    import torch
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"smp.DistributedOptimizer: optimizer={optimizer!r} is not a "
                         "torch.optim.Optimizer")
    if not hasattr(optimizer, "_smp_orig_state_dict"):
        optimizer._smp_orig_state_dict = optimizer.state_dict
        optimizer._smp_orig_load_state_dict = optimizer.load_state_dict
        optimizer.state_dict = types.MethodType(_state_dict, optimizer)
        optimizer.load_state_dict = types.MethodType(_load_state_dict, optimizer)
        optimizer.local_state_dict = types.MethodType(_local_state_dict, optimizer)
    core.state.optimizer = optimizer
    return optimizer
