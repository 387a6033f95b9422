"""Errors that cross pipeline ranks: an exception raised on one rank travels pickled,
with its traceback text and the schedule cell (pp rank, microbatch, backward) where
it was raised, and is raised again on the caller (and, with ABORT, on every rank)."""
import pickle
import traceback

from smp import core
from smp.task import current as _task

__all__ = []


class RemoteTraceback(Exception):
    """Carries the traceback text of an exception raised on another rank."""

    def __str__(self):
        return "\n" + self.args[0]


def error_payload(exc):
    """The exception, its traceback text and the schedule cell (pp rank, microbatch,
    backward) where it was raised: the first cell that failed travels with it."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    where = f"(raised on rank {core.rank()}, pp rank {core.pp_rank()})\n"
    cell = getattr(exc, "_smp_cell", None)
    if cell is None and _task.mb is not None:
        cell = (core.pp_rank(), _task.mb, bool(_task.backward))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # unpicklable exception: carry its text
        blob = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    return pickle.dumps((blob, where + text, cell))


def remote_exception(meta):
    blob, text, cell = pickle.loads(meta)
    exc = pickle.loads(blob)
    try:
        exc._smp_cell = cell
    except AttributeError:
        pass
    return exc, text


def raise_remote(meta):
    exc, text = remote_exception(meta)
    raise exc from RemoteTraceback(text)
