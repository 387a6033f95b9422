"""Errors that cross pipeline ranks: an exception raised on one rank travels pickled,
with its traceback text, the rank it was raised on and the schedule cell (pp rank,
microbatch, backward) where it was raised, and is raised again on the caller (and,
with ABORT, on every rank).

Note [One traceback per error]
The traceback text that travels is always the origin's own: an exception that was
itself received from another rank (`remote_exception`) keeps its origin's text and rank
when it is sent on (the driver forwards a module's error to every pp rank with ABORT),
so no rank prints a chain of chains. The origin rank raises its own exception object
again (`_OwnErrors.own_error` in smp/pipeline.py), with its own traceback, rather
than the copy that came back.
"""
import pickle
import traceback

from smp.ranks import pp_rank, rank
from smp.task import current as _task

__all__ = []


class RemoteTraceback(Exception):
    """Carries the traceback text of an exception raised on another rank."""

    def __str__(self):
        return "\n" + self.args[0]


def error_payload(exc):
    """The exception, its traceback text, the global rank it was raised on and the
    schedule cell (pp rank, microbatch, backward) where it was raised: the first cell
    that failed travels with it. A received exception keeps its origin's text and rank
    (see Note [One traceback per error])."""
    origin = getattr(exc, "_smp_origin", None)
    if origin is None:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        text = f"(raised on rank {rank()}, pp rank {pp_rank()})\n" + text
        origin = rank()
    else:
        text = exc._smp_remote_text
    cell = getattr(exc, "_smp_cell", None)
    if cell is None and _task.mb is not None:
        cell = (pp_rank(), _task.mb, bool(_task.backward))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # unpicklable exception: carry its text
        blob = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    return pickle.dumps((blob, text, cell, origin))


def remote_exception(meta):
    """(exception, its origin's traceback text, the origin's global rank)."""
    blob, text, cell, origin = pickle.loads(meta)
    exc = pickle.loads(blob)
    try:
        exc._smp_cell = cell
        exc._smp_origin = origin
        exc._smp_remote_text = text
    except AttributeError:
        pass
    return exc, text, origin


def raise_remote(meta, own_error=None):
    """Raises the exception in `meta`: `own_error(exc)` (this rank's original object,
    when it is the origin), else the copy, caused by a RemoteTraceback of the origin's
    text."""
    exc, text, origin = remote_exception(meta)
    if origin == rank() and own_error is not None:
        mine = own_error(exc)
        if mine is not None:
            raise mine
    raise exc from RemoteTraceback(text)


def restated(exc, text):
    """An exception of `exc`'s kind whose message is `text` (a RuntimeError where that
    kind cannot be made from a message alone), caused by `exc`: an error with its
    cause added, raised as the kind the user's code catches."""
    try:
        error = type(exc)(text)
    except Exception:  # noqa: BLE001  (a constructor that takes other arguments)
        error = RuntimeError(text)
    error.__cause__ = exc
    return error
