"""Asynchronous saves (`smp.save(..., async_save=True)`, `smp.save_checkpoint(...,
async_save=True)`): stage, hand to C++'s writer thread, settle later.

Note [Asynchronous save]
~~~~~~~~~~~~~~~~~~~~~~~~
- At the call, on the calling thread: the object is pickled by torch (structure only,
  Note [One writer] in checkpoint/writer.cpp) and every tensor's bytes are copied into
  host buffers that are allocated at the first save and reused by every later one (the
  staging: the only time training waits). The file holds the state at the call,
  whatever training does next (pytorch#144657 is DCP's defect of this kind).
- On the C++ writer thread: the zip is written from the staged bytes, hashed as it goes,
  sealed, fsynced and renamed onto its name (`publish`). A partial save's parts are
  renamed without first agreeing that every part was sealed: Note [Generations] keeps
  the old-or-new guarantee, because readers take the newest save present for every part
  and the previous generation stays at `f_p.prev` until the save is settled.
- Settling, on the calling thread, collective over the save's group (every rank of the
  save, in the same order, so never from the writer's thread): each rank's writer
  outcome is agreed. A failure is raised on every rank of the save, naming the file.
  Success drops `.prev`, and for save_checkpoint moves `newest` to the tag, so
  `resume_from_checkpoint(tag=None)` never picks a save that is not complete.
  A save settles at the next save or load, at `future.wait()`, at the end of a step
  where every rank's writer has finished (one small allgather per step while a save is
  pending), at `smp.shutdown()`, and at a clean interpreter exit.
- An exit after a failure (or `os._exit`) still waits for the writer (atexit), but
  does not settle: the files are whole and committed, `newest` still names the save
  before. A SIGKILL leaves at most a temporary (`.name.tmp-*`), which no reader opens.
"""
import ctypes
import random
import time

import torch

import smp._C as _C
from smp import agreement, runtime
from smp.checkpoint._common import CheckpointError, check_bool, naming_verdict
from smp.process_state import is_initialized, state

__all__ = []


def check_flag(fn, async_save):
    check_bool(fn, "async_save", async_save)
    return async_save


# ---- staging ------------------------------------------------------------------------

class _Pool:
    """Host buffers by size, reused from save to save (pinned where CUDA is)."""

    def __init__(self):
        self._free = {}
        self._pin = None

    def take(self, nbytes):
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        if self._pin is None:
            self._pin = torch.cuda.is_available()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)

    def give(self, bufs):
        for b in bufs:
            self._free.setdefault(b.numel(), []).append(b)


_pool = _Pool()


def stage(records):
    """The records with every storage's bytes copied into pool buffers; returns
    (records, the buffers taken). The pickle's records are small and already copies.
    CPU bytes are copied with memcpy (glibc's: ~20% faster than a uint8 copy_ here)."""
    out, taken, cuda = [], [], False
    for name, t in records:
        if name.startswith("data/"):
            buf = _pool.take(t.numel())
            if t.device.type == "cpu":
                ctypes.memmove(buf.data_ptr(), t.data_ptr(), t.numel())
            else:
                buf.copy_(t, non_blocking=True)
                cuda = True
            taken.append(buf)
            t = buf
        out.append((name, t))
    if cuda:
        torch.cuda.synchronize()
    return out, taken


# ---- save ids without a collective ----------------------------------------------------

_id_base = {}


def save_id(group, agree_base):
    """An id for the next save of `group`'s ranks, the same on each of them without a
    collective: the first asynchronous save of the group agrees on a random base
    (`agree_base(proposal)` returns rank 0's), later ones add how many saves the group
    has made (every rank of the group saves in the same order)."""
    base, n = _id_base.get(group, (None, 0))
    if base is None:
        base = agree_base(random.getrandbits(63))
    _id_base[group] = (base, n + 1)
    return (base + n * 0x9E3779B97F4A7C15) & ((1 << 63) - 1)


# ---- pending saves ------------------------------------------------------------------

class _Save:
    """One asynchronous save as this rank sees it: its writer jobs, the group that
    settles it (None: this rank alone), what to do once every rank's part is in."""

    def __init__(self, what, group):
        self.what = what
        self.group = group
        self.jobs = []          # (job number, final path, who)
        self.buffers = []
        self.on_commit = []     # callables, after the group agreed
        self.error = None       # set once settled with a failure
        self.settled = False
        self.refused = None     # this rank's error found at the call (agreed at settling)

    def local_outcome(self, timeout_s):
        """(finished, error text or None) of this rank's jobs; waits up to timeout_s."""
        if self.refused is not None:
            return True, self.refused
        deadline = time.monotonic() + timeout_s
        for job, final, who in self.jobs:
            done, err = _C.checkpoint_wait(job, max(0.0, deadline - time.monotonic()))
            if not done:
                return False, None
            if err:
                return True, f"{self.what}: writing '{final}' failed on {who}: {err}"
        return True, None


_pending = []
_collecting = []


def _timeout_s():
    return float(state.cfg.timeout_s) if is_initialized() else 300.0


def begin(what, group):
    """A new asynchronous save (or, inside collect(), the save being collected)."""
    if _collecting:
        return _collecting[-1]
    return _Save(what, group)


def submit(save, records, tmp, final, manifest, who, keep_previous):
    """Stages `records` and queues their write on C++'s writer thread."""
    records, taken = stage(records)
    save.buffers.extend(taken)
    job = _C.checkpoint_submit(records, tmp, final, manifest, True, keep_previous)
    save.jobs.append((job, final, who))


def commit(save, fn):
    save.on_commit.append(fn)


def start(save):
    """Registers `save` (unless collect() gathers it); returns its future."""
    if _collecting and _collecting[-1] is save:
        return SaveFuture(save)
    _pending.append(save)
    return SaveFuture(save)


class collect:
    """Within `with collect(what, group) as save:`, every asynchronous save joins one
    (save_checkpoint's model, optimizer and user content settle together)."""

    def __init__(self, what, group):
        self.save = _Save(what, group)

    def __enter__(self):
        _collecting.append(self.save)
        return self.save

    def __exit__(self, *exc):
        _collecting.pop()
        if exc[0] is None:
            _pending.append(self.save)
        else:
            _abandon(self.save)
        return False


def _abandon(save):
    """A save whose call failed before it was registered: its writes still finish
    (their buffers are in use until then), and nothing is committed by it."""
    for job, _, _ in save.jobs:
        _C.checkpoint_wait(job, _timeout_s())
    _pool.give(save.buffers)


_verdict = naming_verdict("rank", " of the save")


def _settle_one(save, block):
    """Agrees on `save`'s outcome over its group. With block=False, returns False
    (nothing settled) when some rank's writer is still busy. Collective over the group
    either way."""
    done, err = save.local_outcome(_timeout_s() if block else 0.0)
    if block and not done:
        err = (f"{save.what}: the background write of "
               f"{', '.join(repr(f) for _, f, _ in save.jobs)} did not finish within "
               f"timeout_s={_timeout_s():g} s")
        done = True
    group = save.group
    if group is None or not is_initialized():
        everyone = [done]
        if err is not None:
            save.error = err
    else:
        try:
            everyone = agreement.agree(None if err is None else CheckpointError(err), group,
                                       _verdict, value=done)
        except CheckpointError as e:
            save.error = str(e)
    if save.error is None and not all(everyone):
        return False
    _pending.remove(save)
    save.settled = True
    if save.error is not None:
        _abandon(save)
        raise CheckpointError(save.error)
    _pool.give(save.buffers)
    for fn in save.on_commit:
        fn()
    return True


def settle():
    """Settles every pending save, oldest first (collective over each one's group)."""
    while _pending:
        _settle_one(_pending[0], True)


def at_step_end():
    """Settles the pending saves whose writes every rank finished (Note [Asynchronous
    save]); a failure is raised here, on every rank of the save."""
    while _pending and _settle_one(_pending[0], False):
        pass


def _teardown(how):
    """smp.shutdown() ("shutdown") settles every pending save; a clean interpreter exit
    ("exit") too, but never raises; an exit after an error ("failed") only waits for the
    writer. See smp/runtime.py's teardown hooks."""
    try:
        if how == "shutdown":
            settle()
        elif how == "exit" and _pending:
            try:
                settle()
            except Exception:  # noqa: BLE001  (never raise on the exit path)
                pass
    finally:
        _C.checkpoint_flush()


runtime.register_teardown(_teardown)


class SaveFuture:
    """What an asynchronous save returns once the state is staged.

    `wait(timeout=None)`: settles the save (collective over the ranks of the save: call it
    on each of them) and raises smp.CheckpointError on every one of them if any rank's
    write failed. `done()`: whether this rank's writes finished (no collective).
    `result()` is `wait()`."""

    def __init__(self, save):
        self._save = save

    def done(self):
        return self._save.settled or self._save.local_outcome(0.0)[0]

    def wait(self, timeout=None):
        if timeout is not None:
            self._save.local_outcome(float(timeout))
        while not self._save.settled and self._save in _pending:
            _settle_one(_pending[0], True)
        if self._save.error is not None:
            raise CheckpointError(self._save.error)

    result = wait
