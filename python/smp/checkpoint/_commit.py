"""Writing checkpoint files: a sealed temporary beside the final name, then the atomic
rename, and for a partial save the two-phase commit over the pp group.

Two phases: every part is written and sealed under a temporary name, the pp group
agrees that all were, and only then is each renamed to its final name; the group
agrees again that every rename succeeded before the previous generation is dropped.
See Note [Generations] in checkpoint/checkpoint.cpp for what a reader does with a save
that stopped in between.
"""
import os
import random
import time

import torch

import smp._C as _C
from smp import ranks
from smp.checkpoint import _async, _torch_save
from smp.checkpoint._common import CheckpointError, agree, part_of_rank, topology
from smp.checkpoint._crash import crash_point
from smp.collectives import allgather
from smp.groups import CommGroup
from smp.process_state import is_initialized, state

__all__ = []


def manifest(partial, part, parts, save_id, save_time_ns):
    _, pp, _, dp, world = topology()
    m = _C.Manifest()
    m.save_id, m.save_time_ns = save_id, save_time_ns
    m.partial, m.part, m.parts = partial, part, parts
    m.world_size, m.pp_size, m.dp_size = world, pp, dp
    model = state.model if is_initialized() else None
    m.plan_hash = getattr(model, "_plan_hash", 0) or 0
    m.torch_version = torch.__version__
    return m


def _tmp_path(final):
    d, base = os.path.split(os.path.abspath(final))
    return os.path.join(d, f".{base}.tmp-{os.getpid()}-{random.getrandbits(48):012x}")


def write_sealed(obj, final, m, pickle_module, pickle_protocol):
    """`obj` pickled by torch and written by C++ (Note [One writer] in
    checkpoint/writer.cpp) to a sealed, fsynced temporary beside `final`. Returns its
    path."""
    tmp = _tmp_path(final)
    try:
        _C.checkpoint_write(tmp, _torch_save.records_of(obj, pickle_module, pickle_protocol), m)
        if m.partial:
            crash_point("after_write")
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return tmp


def write_full(obj, path, pickle_module, pickle_protocol):
    """`path`, written by this rank alone."""
    m = manifest(False, 0, 1, random.getrandbits(63), time.time_ns())
    tmp = write_sealed(obj, path, m, pickle_module, pickle_protocol)
    _C.checkpoint_publish(tmp, path, False)


def write_part(obj, path, missing, pickle_module, pickle_protocol):
    """This pp rank's part `f"{path}_{pp_rank}"` of a partial save; collective over the
    pp group (dp rank 0's). Under tp, this (pp rank, tp rank)'s part
    `f"{path}_{pp_rank * tp_size + tp_rank}"`, collective over the mp group of rdp rank
    0 (Note [Slices in checkpoints] in smp/tp_state.py). `missing`: the error to agree
    on instead of writing (the directory does not exist), or None."""
    part, parts, who, group = part_of_rank()
    _two_phases(obj, f"{path}_{part}", part, parts, who, False, missing, pickle_module,
                pickle_protocol, group)


def write_shard(obj, path, missing, pickle_module, pickle_protocol):
    """This rank's shard `f"{path}_{pp_rank}_{dp_rank}"` (smp.save(..., v3=True): every
    rank writes its own, e.g. its share of a sharded optimizer's state); collective over
    the world, with the same two phases as write_part."""
    pp_rank, _, dp_rank, _, world = topology()
    rank = ranks.rank() if is_initialized() else 0
    _two_phases(obj, f"{path}_{pp_rank}_{dp_rank}", rank, world, f"rank {rank}", True,
                missing, pickle_module, pickle_protocol)


def _two_phases(obj, final, part, parts, who, world, missing, pickle_module, pickle_protocol,
                group=None):
    """Writes part `part` of `parts` as `final`: sealed under a temporary name, the
    group (the pp group, with `world` the world, or `group`) agrees that every part
    was, each is renamed, and the group agrees that every rename succeeded."""
    save_id, t_ns = (random.getrandbits(63), time.time_ns())
    if group is None:
        group = CommGroup.WORLD if world else CommGroup.PP_GROUP
    if parts > 1:
        save_id, t_ns = allgather((save_id, t_ns), group)[0]
    tmp, err = None, missing
    try:
        if err is None:
            tmp = write_sealed(obj, final, manifest(True, part, parts, save_id, t_ns),
                               pickle_module, pickle_protocol)
    except Exception as e:  # noqa: BLE001  (reported on every rank below)
        err = f"smp.save: writing '{final}' failed on {who}: {e}"
    crash_point("after_seal")
    try:
        agree(err, "every part sealed before any is renamed", world=world, group=group)
    except CheckpointError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise
    # See Note [Generations] in checkpoint/checkpoint.cpp.
    err = None
    crash_point("before_rename")
    try:
        _C.checkpoint_publish(tmp, final, True)
    except Exception as e:  # noqa: BLE001
        err = f"smp.save: renaming '{final}' failed on {who}: {e}"
    crash_point("after_rename")
    agree(err, "every part renamed", world=world, group=group)
    _C.checkpoint_drop_previous(final)


# ---- asynchronous (Note [Asynchronous save] in _async.py) ---------------------------

def write_full_async(obj, path, pickle_module, pickle_protocol, what):
    """`path`, by this rank alone, on the writer thread; returns its future."""
    m = manifest(False, 0, 1, random.getrandbits(63), time.time_ns())
    save = _async.begin(what, None)
    _async.submit(save, _torch_save.records_of(obj, pickle_module, pickle_protocol),
                  _tmp_path(path), path, m, "this rank", False)
    return _async.start(save)


def write_part_async(obj, path, missing, pickle_module, pickle_protocol, what):
    """This pp rank's part of a partial save, on the writer thread; collective over the
    pp group (dp rank 0's) at the call and when it settles."""
    part, parts, who, group = part_of_rank()
    return _one_phase(obj, f"{path}_{part}", part, parts, who, False, missing, pickle_module,
                      pickle_protocol, what, group)


def write_shard_async(obj, path, missing, pickle_module, pickle_protocol, what):
    """write_shard's asynchronous form; collective over the world."""
    pp_rank, _, dp_rank, _, world = topology()
    rank = ranks.rank() if is_initialized() else 0
    return _one_phase(obj, f"{path}_{pp_rank}_{dp_rank}", rank, world, f"rank {rank}", True,
                      missing, pickle_module, pickle_protocol, what)


def _one_phase(obj, final, part, parts, who, world, missing, pickle_module, pickle_protocol,
               what, group=None):
    """Each rank's writer seals and renames its part, keeping the previous generation
    (Note [Generations]), which goes once the save settles. No collective at the call
    (after the group's first asynchronous save, which agrees on the base of its save
    ids): a missing directory is this rank's error, agreed when the save settles, as a
    writer's failure is."""
    if group is None:
        group = CommGroup.WORLD if world else CommGroup.PP_GROUP
    save_id = _async.save_id(group, lambda mine: allgather(mine, group)[0] if parts > 1
                             else mine)
    save = _async.begin(what, group)
    if missing is not None:
        save.refused = missing
    else:
        _async.submit(save, _torch_save.records_of(obj, pickle_module, pickle_protocol),
                      _tmp_path(final), final,
                      manifest(True, part, parts, save_id, time.time_ns()), who, True)
        _async.commit(save, lambda: _C.checkpoint_drop_previous(final))
    return _async.start(save)
