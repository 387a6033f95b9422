"""Reading checkpoint files: C++ reads and verifies every byte (`_C.checkpoint_*`), and
torch's own loader unpickles the records it read (one read of the file). A partial
save is read part by part, each rank the parts that hold its layers, and the pp group
agrees on the verdict."""
import os
import pickle
import re

import smp._C as _C
from smp import tp_state
from smp.checkpoint import _torch_load
from smp.checkpoint._common import CheckpointError, agree
from smp.checkpoint._parts import merge, tp_parts

__all__ = []


class _Records:
    """The records of one verified file, in the shape torch's zip loader reads."""

    def __init__(self, records):
        self._r = {name.split("/", 1)[1] if "/" in name else name: t
                   for name, t in records.items()}

    def get_record(self, name):
        return self._r[name].numpy().tobytes()

    def has_record(self, name):
        return name in self._r

    def get_all_records(self):
        return list(self._r)

    def get_storage_from_record(self, name, numel, dtype):
        return self._r[name]

    def serialization_id(self):
        return self.get_record(".data/serialization_id").decode() \
            if self.has_record(".data/serialization_id") else ""


def _refused(path, reason):
    """The error for a file torch's weights-only unpickler refused (Note [smp.load and
    weights_only] in _torch_load.py)."""
    ours = (" It holds an smp object that smp does not allow there: smp's comm hooks and "
            "PowerSGDState load weights-only (Note [Hook state loads weights-only] in "
            "smp/ddp_comm_hooks/_safe.py); other objects do not."
            if "smp." in reason else "")
    return CheckpointError(
        f"smp.load: '{path}' holds objects that weights_only=True refuses: it loads tensors, "
        "plain containers and numbers only (and what torch.serialization.add_safe_globals "
        f"allows).{ours} Pass weights_only=False only for a file you trust. "
        f"torch's reason: {reason}")


def unpickle(records, map_location, pickle_module, pickle_load_args, weights_only=False,
             path=None):
    try:
        return _torch_load.unpickle(_Records(records), map_location, pickle_module,
                                    weights_only, pickle_load_args)
    except _torch_load.WeightsOnlyRefused as e:
        raise _refused(path, str(e)) from None


def unpickle_records(records, path):
    """The object pickled in `records` (an object with torch's zip-reader methods),
    unpickled as smp.load does by default (pickle_module=pickle)."""
    try:
        return _torch_load.unpickle(records, None, pickle, False, {})
    except _torch_load.WeightsOnlyRefused as e:
        raise _refused(path, str(e)) from None


def read_full(path, map_location, pickle_module, weights_only, pickle_load_args):
    """The object in full file `path` (a plain torch.save file loads too)."""
    if not os.path.exists(path):
        raise CheckpointError(f"smp: checkpoint '{path}' does not exist")
    if not _C.checkpoint_has_manifest(path):
        # A plain torch.save file (SMP v1: full checkpoints of non-smp models load too).
        try:
            return _torch_load.load_plain(path, map_location, pickle_module, weights_only,
                                          pickle_load_args)
        except _torch_load.WeightsOnlyRefused as e:
            raise _refused(path, str(e)) from None
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"smp: checkpoint '{path}' has no smp trailer (truncated, or "
                                  f"not written by smp.save) and torch.load fails: {e}") from e
    if _torch_load.maps(path, map_location, pickle_load_args):
        # Checked whole, then mapped: each tensor's pages are read when touched (Note
        # [Mapped loads] in _torch_load.py). The file is the zip torch.save writes.
        _C.checkpoint_verify(path)
        try:
            return _torch_load.load_plain(path, map_location, pickle_module, weights_only,
                                          pickle_load_args)
        except _torch_load.WeightsOnlyRefused as e:
            raise _refused(path, str(e)) from None
    _, records = _C.checkpoint_read_verified(path)
    return unpickle(records, map_location, pickle_module, pickle_load_args, weights_only, path)


def read_parts(path, pp_rank, pp_size, map_location, pickle_module, weights_only,
               pickle_load_args, tp_rank=0, tp_size=1):
    """What the parts of partial save `path` that this rank reads hold, merged;
    collective over the pp group, which agrees first on every part's bytes and then on
    unpickling them. A save under tp has a part per (pp rank, tp rank): a rank reads
    its own tp rank's, or with another tp size every tp rank's (_parts.tp_parts)."""
    err, paths, got, mine = None, None, [], []
    try:
        paths, m = _C.checkpoint_resolve_partial(path)
        mine = tp_parts(len(paths), m.pp_size, pp_rank, pp_size, tp_rank, tp_size)
        for p in mine:
            got.append(_C.checkpoint_read_verified(paths[p])[1])
    except CheckpointError as e:
        err = str(e)
    agree(err, "verifying the partial checkpoint")
    objs = []
    try:
        for p, r in zip(mine, got):
            objs.append(unpickle(r, map_location, pickle_module, pickle_load_args,
                                 weights_only, paths[p]))
    except CheckpointError as e:  # a weights-only refusal: parts differ, so agree on it
        err = str(e)
    agree(err, "unpickling the partial checkpoint")
    return merge(objs)


def shard_files(path):
    """The shards `f"{path}_{pp}_{dp}"` smp.save(..., v3=True) wrote, in (pp, dp) order."""
    d, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(base) + r"_(\d+)_(\d+)$")
    found = []
    for name in os.listdir(d) if os.path.isdir(d) else ():
        m = pattern.match(name)
        if m:
            found.append((int(m.group(1)), int(m.group(2)), os.path.join(d, name)))
    return [f for _, _, f in sorted(found)]


def has_shards(path):
    """Whether `path` names smp.save(..., v3=True) shards (and no pp parts)."""
    return not os.path.exists(f"{path}_0") and bool(shard_files(path))


def read_shards(path, rank, world, map_location, pickle_module, weights_only,
                pickle_load_args):
    """The shards this rank reads: the first one (each rank needs something to merge
    into), and every `world`-th from `rank` (so that together the ranks read each once,
    whatever the saving job's layout). Shares saved under tensor parallelism (their
    `_smp_tp` table, Note [Sharded tp slices] in smp/optimizer_sharding.py): every
    shard, since the tp pieces of one slice's state are in shares of different ranks
    and are combined by position, not by name. Collective over the world (the verdict).
    """
    files = shard_files(path)
    objs, err = [], None
    if not files:
        err = f"smp: no shards '{path}_<pp>_<dp>' (smp.save(..., v3=True)) exist"
    else:
        try:
            objs.append(read_full(files[0], map_location, pickle_module, weights_only,
                                  pickle_load_args))
            # (shard 0 decides, and every rank reads it: the ranks choose alike)
            rest = range(1, len(files)) if tp_state.has_table(objs[:1]) else \
                sorted(set(range(rank, len(files), world)) - {0})
            for i in rest:
                objs.append(read_full(files[i], map_location, pickle_module, weights_only,
                                      pickle_load_args))
        except Exception as e:  # noqa: BLE001  (reported on every rank below)
            err = str(e)
    agree(err, "every rank read its shards", world=True)
    return objs
