"""Object collectives on smp's groups: barrier, allgather, gather, and buffered
point-to-point (send, recv_from, broadcast) through the store. Objects are pickled
here; C++ moves the bytes (smp_core/comm.h) after checking that every member is about
to make the same call (Note [Call agreement] in smp_core/call_agreement.h)."""
import contextlib
import pickle
import sys
import threading

import smp._C as _C
from smp.groups import CommGroup, group_name
from smp.process_state import require_init, state
from smp.ranks import RankType, members, to_global

__all__ = []

# Note [Naming the call]: every smp collective on a group first checks, through the
# store, that every member is about to make the same user-facing call (Note [Call
# agreement] in smp_core/call_agreement.h); errors name that call. The outermost
# `api_call` on the thread names it (model.state_dict() runs allgathers inside);
# without one, the collective's own name ("smp.barrier(WORLD)").
_api_call = threading.local()
# The name of a step's collectives (its first step agrees on the model and the plan):
# the same on a rank that shadows the step under join, whatever the function's name.
STEP_CALL = "an @smp.step function"


@contextlib.contextmanager
def api_call(name):
    """Names the user-facing call whose collectives run inside (the outermost wins);
    also a decorator: `@api_call("smp.save()")`."""
    outer = getattr(_api_call, "name", None)
    if outer is None:
        _api_call.name = name
    try:
        yield
    finally:
        if outer is None:
            _api_call.name = None


def _call_name(default):
    return getattr(_api_call, "name", None) or default


# One spelling per group in call names: with tp = 1, MP_GROUP is PP_GROUP and RDP_GROUP
# is DP_GROUP (groups.group_name), so smp.mp_barrier() on one rank agrees with
# smp.pp_barrier() on another.
_CALL_GROUP = {"world": "WORLD", "pp": "PP_GROUP", "dp": "DP_GROUP", "tp": "TP_GROUP",
               "rdp": "RDP_GROUP", "mp": "MP_GROUP"}


def _alone(name):
    """A tp group of one rank (tp = 1): nothing to wait for or gather."""
    return name == "tp" and state.topology.tp_size == 1


def agree_call(group, default):
    """Before a torch collective on an smp group (e.g. dist.gather_object): every member
    of `group` is about to make the same call (see Note [Naming the call]).

    Raises:
        CommError: a member made another call, waits in a call on another group, or
            exited (named, on every waiting rank).
        SMPTimeoutError: a member did not arrive within timeout_s.
    """
    name = group_name(group)
    if not _alone(name):
        _C.agree_call(name, _call_name(default))


def mark_exited():
    """At exit (smp.runtime's handler): ranks waiting for this one in an smp call raise
    at once, naming how it ended; rank 0 (the store's host under smprun) lingers
    briefly so they can read it."""
    try:  # also drops C++'s reference to the store (after smp.shutdown too)
        exc = getattr(sys, "last_value", None)
        how = "exited" if exc is None else f"failed ({type(exc).__name__}: {exc})"
        _C.mark_exited(how, 5.0 if state.initialized and state.rank == 0 else 0.0)
    except Exception:  # the store is gone: nobody is left to read it
        pass


def barrier(group=CommGroup.WORLD):
    """Blocks until every member of `group` arrives (bounded by timeout_s).

    Raises:
        CommError: a member made another smp call instead, or exited (named).
        SMPTimeoutError: a member did not arrive within timeout_s.
    """
    require_init()
    name = group_name(group)
    if not _alone(name):
        _C.barrier(name, _call_name(f"smp.barrier({_CALL_GROUP[name]})"))


def pp_barrier():
    barrier(CommGroup.PP_GROUP)


def dp_barrier():
    barrier(CommGroup.DP_GROUP)


def mp_barrier():
    barrier(CommGroup.MP_GROUP)


def send(obj, dest_rank, rank_type=RankType.WORLD_RANK):
    """Sends a picklable object; buffered, so it returns before the receiver asks."""
    require_init()
    _C.send_bytes(to_global(dest_rank, rank_type), pickle.dumps(obj, protocol=4))


def recv_from(src_rank, rank_type=RankType.WORLD_RANK):
    """Receives the next object `src_rank` sent (by send or broadcast) to this rank."""
    require_init()
    return pickle.loads(_C.recv_bytes(to_global(src_rank, rank_type)))


def broadcast(obj, group=CommGroup.WORLD):
    """Sends `obj` to every other member of `group`; they receive with recv_from."""
    require_init()
    data = pickle.dumps(obj, protocol=4)
    for r in members(group):
        if r != state.rank:
            _C.send_bytes(r, data)


def allgather(obj, group=CommGroup.WORLD):
    """Returns every member's `obj`, in group-rank order."""
    require_init()
    name = group_name(group)
    if _alone(name):
        return [obj]
    call = _call_name(f"smp.allgather({_CALL_GROUP[name]})")
    return [pickle.loads(b) for b in _C.allgather_bytes(name, pickle.dumps(obj, protocol=4),
                                                        call)]


def gather(obj, group=CommGroup.WORLD, rank=0):
    """Returns the members' objects in group-rank order on group rank `rank`, else None."""
    with api_call(f"smp.gather({_CALL_GROUP[group_name(group)]})"):
        values = allgather(obj, group)
    me = members(group).index(state.rank)
    return values if me == rank else None
