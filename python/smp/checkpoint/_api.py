"""`smp.save` and `smp.load` (SMP v1): argument checks and the choice between a full
file and a partial save; writing is `_commit.py`'s, reading `_read.py`'s."""
import os
import pickle

from smp import ranks, tp_state
from smp.checkpoint import _async, _commit, _hook_state, _parts, _read, _torch_load
from smp.checkpoint._common import (PARTIAL_KEY, CheckpointError, check_bool, check_path,
                                   topology, tp_layout)
from smp.collectives import api_call
from smp.model_state import SHARDS_KEY
from smp.process_state import is_initialized

__all__ = []


def _missing_directory(fn, path):
    """The user's message when `path`'s directory does not exist, else None."""
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(d):
        return None
    return (f"smp.{fn}: directory '{d}' does not exist (saving '{path}'): create it before "
            f"saving (os.makedirs('{d}', exist_ok=True) on one rank, then smp.barrier()), "
            "or pass a file name in an existing directory")


@api_call("smp.save()")  # Note [Naming the call] in smp/collectives.py
def save(obj, f, partial=True, pickle_module=pickle, pickle_protocol=2, v3=False, *,
         async_save=False, **kwargs):
    """Saves `obj` atomically to `f` (full) or `f"{f}_{pp_rank}"` (partial).

    Args:
        obj: what to save (typically a dict of state dicts).
        f: a file name. The directory must exist.
        partial: True: every rank of the pp group (the ranks with dp_rank() == 0; other
            dp ranks skip the write, so they may call too) writes its part; the call is
            collective over the pp group. Under tensor parallelism every rank of the mp
            group with rdp_rank() == 0 writes its part `f"{f}_{pp_rank * tp_size +
            tp_rank}"` (its slices: Note [Slices in checkpoints] in smp/tp_state.py),
            collective over that group. False: the calling rank writes `f` alone.
        pickle_module, pickle_protocol: as torch.save.
        v3: with partial=True, every rank writes its own shard `f"{f}_{pp_rank}_{dp_rank}"`
            (SMP 1.10's layout for state sharded over dp, e.g. a sharded optimizer's
            `local_state_dict(gather_if_shard=False)`); collective over the world.
            smp.load(f, partial=True) reads such shards back.
        async_save: True: returns once the state is staged (copied into reused host
            buffers), with an `smp.checkpoint.SaveFuture`; C++'s writer thread writes,
            hashes, fsyncs and commits the files (Note [Asynchronous save] in
            smp/checkpoint/_async.py). The save settles (a failure raised on every rank
            of the save) at the next save or load, `future.wait()`, a step end, or
            smp.shutdown(). False (SMP's): returns once the files are committed.

    Every save and load first settles the asynchronous saves still pending.

    Returns:
        None, or with async_save=True the save's future.

    Raises:
        CheckpointError: a part could not be written (raised on every rank of the group);
            `f`'s directory does not exist (on every rank that calls, the same message).
        ValueError: a bad argument.
    """
    path = check_path("save", f)
    check_bool("save", "partial", partial)
    check_bool("save", "v3", bool(v3) if v3 in (0, 1) else v3)
    if kwargs:
        raise ValueError(f"smp.save: unexpected arguments {sorted(kwargs)} (allowed: partial, "
                         "pickle_module, pickle_protocol, v3, async_save)")
    _async.check_flag("save", async_save)
    _async.settle()
    obj = _hook_state.strip(obj)
    # The writers of a partial save: dp rank 0's pp group, or under tensor parallelism
    # rdp rank 0's mp group, each (pp rank, tp rank) its part (Note [Slices in
    # checkpoints] in smp/tp_state.py).
    _, tp_size, rdp_rank = tp_layout()
    writer_rank = rdp_rank if tp_size > 1 else topology()[2]
    missing = _missing_directory("save", path)
    what = "smp.save(async_save=True)"
    if partial and v3:  # every rank writes (the world agrees on `missing` too)
        if async_save:
            return _commit.write_shard_async(obj, path, missing, pickle_module, pickle_protocol,
                                             what)
        _commit.write_shard(obj, path, missing, pickle_module, pickle_protocol)
        return None
    if missing and (not partial or writer_rank != 0):
        raise CheckpointError(missing)  # the writers below agree on it first
    if not partial:
        if async_save:
            return _commit.write_full_async(obj, path, pickle_module, pickle_protocol, what)
        _commit.write_full(obj, path, pickle_module, pickle_protocol)
        return None
    if writer_rank != 0:
        # dp replicas hold the same state; dp rank 0's pp group (rdp rank 0's mp group)
        # writes it
        return _async.start(_async.begin(what, None)) if async_save else None
    if async_save:
        return _commit.write_part_async(obj, path, missing, pickle_module, pickle_protocol, what)
    _commit.write_part(obj, path, missing, pickle_module, pickle_protocol)
    return None


@api_call("smp.load()")
def load(f, map_location=None, pickle_module=pickle, partial=True, back_compat=False, *,
         weights_only=None, **pickle_load_args):
    """Loads what smp.save wrote, after verifying every byte of what it reads.

    Args:
        f: the name given to smp.save.
        map_location, pickle_module, **pickle_load_args: as torch.load.
        weights_only: as torch.load's: True unpickles with torch's weights-only unpickler
            (tensors, plain containers, numbers, and what
            torch.serialization.add_safe_globals allows; not smp's comm hook states).
            None: torch.load's choice for this pickle_module, so with the default
            pickle_module=pickle everything loads (SMP v1; checkpoints hold optimizer
            state and user content). See Note [smp.load and weights_only].
        partial: True: a partial save (`f_0`, `f_1`, ...): call on every rank; each rank
            reads the parts that hold its layers (with a different pp_size than the
            saving job, several or a shared one) and the pp group agrees on the verdict.
            False: the full file `f` (a plain torch.save file loads too).
        back_compat: accepted for SMP 1.10 compatibility.

    Raises:
        CheckpointError: a missing, truncated or altered file, or parts of different
            saves, or (weights-only unpickling) a file holding other objects; with
            partial=True raised on every rank of the pp group, naming the file.
        ValueError: a bad argument (weights_only not None/True/False, weights-only
            unpickling with a pickle_module other than pickle or None, mmap).
    """
    path = check_path("load", f)
    check_bool("load", "partial", partial)
    _async.settle()
    mmap = pickle_load_args.pop("mmap", None)
    if mmap:
        raise ValueError(f"smp.load: argument 'mmap'={mmap!r} is not "
                         "supported (smp verifies every byte it reads into memory; use "
                         "torch.load(..., mmap=True) on a full file)")
    weights_only = _torch_load.resolve_weights_only("load", weights_only, pickle_module)
    if not partial:
        return _hook_state.rebind(_read.read_full(path, map_location, pickle_module,
                                                  weights_only, pickle_load_args))
    pp_rank, pp_size, _, _, world = topology()
    tp_rank, tp_size, _ = tp_layout()
    if _read.has_shards(path):
        # smp.save(..., v3=True)'s shards: each rank reads its round of them, and the
        # entries they hold are merged (state by name: an optimizer's shares).
        rank = ranks.rank() if is_initialized() else 0
        objs = _read.read_shards(path, rank, world, map_location, pickle_module,
                                 weights_only, pickle_load_args)
        return _hook_state.rebind(_merge_shards(objs))
    return _hook_state.rebind(_read.read_parts(path, pp_rank, pp_size, map_location,
                                               pickle_module, weights_only, pickle_load_args,
                                               tp_rank, tp_size))



def _merge_shards(objs):
    """One dict from the shards a rank read: dicts merge key by key ("state" entries
    by name), anything else is the first shard's. Shares saved under tensor
    parallelism (every shard read) merge as the parts of a partial save: a slice's
    state read from several tp ranks' shares is a `smp.tp_state.Slices`, from which
    `load_state_dict` gives each rank its own piece (Note [Slices in checkpoints])."""
    first = objs[0]
    if not isinstance(first, dict):
        return first
    if tp_state.has_table(objs):
        out = _parts.merge(objs)
        out.pop(PARTIAL_KEY, None)  # every share is in: a complete state
        return out
    out = dict(first)
    for o in objs[1:]:
        for k, v in o.items():
            if isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = {**out[k], **v}
            else:
                out.setdefault(k, v)
    out[SHARDS_KEY] = True  # entries may be on any rank of the world
    return out
