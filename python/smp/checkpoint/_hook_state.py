"""Pickling of comm hooks and their states.

Built-in hooks are module-level Python functions (smp/ddp_comm_hooks/_builtin.py): they
pickle by reference as any function does. A hook state's process group never enters a
file: states drop it (`__getstate__`) or, when they do not, a copy with
`process_group=None` is saved; on load smp's dp group is put back (`rebind`).
"""
import copy

from smp.groups import get_dp_process_group
from smp.process_state import is_initialized

__all__ = []


def strip(obj):
    """`obj` as saved: its "comm_hook_state" without a process group."""
    if isinstance(obj, dict) and "comm_hook_state" in obj:
        state = obj["comm_hook_state"]
        own_getstate = getattr(type(state), "__getstate__", None) not in (
            None, getattr(object, "__getstate__", None))
        if getattr(state, "process_group", None) is not None and not own_getstate:
            state = copy.copy(state)
            state.process_group = None
            obj = dict(obj)
            obj["comm_hook_state"] = state
    return obj


def rebind(obj):
    """`obj` as loaded: its "comm_hook_state" on smp's dp group again."""
    if isinstance(obj, dict) and "comm_hook_state" in obj and is_initialized():
        state = obj["comm_hook_state"]
        if hasattr(state, "process_group") and state.process_group is None:
            try:
                state.process_group = get_dp_process_group()
            except AttributeError:
                pass
    return obj
