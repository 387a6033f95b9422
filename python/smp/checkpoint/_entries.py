"""Reads by entry (Note [Reads by entry] in checkpoint/mapped.cpp): what
resume_from_checkpoint loads, each rank reading and verifying only the tensors it keeps.

Every part of the save is opened (trailer, entry table, pickle: small) and unpickled
with its tensors over the mapped file, unread. The parts merge into one complete state
(every entry, from whichever part holds it), so no entry travels between ranks. The
dict carries `smp_entries`, which `DistributedModel.load_state_dict` and
`DistributedOptimizer.load_state_dict` call on the values they keep, before using them:
`check(values)` verifies the records behind them (collective over the world: a damaged
record is raised on every rank, naming the file and the record), `take(values)` gives
copies off the mapping (for state that is kept as it is, not copied into a tensor).
Version 1 files (no entry table) are read whole and verified, as smp.load does.
"""
import os
import pickle

import torch

import smp._C as _C
from smp.checkpoint import _parts, _read
from smp.checkpoint._common import PARTIAL_KEY, CheckpointError, agree
from smp.model_state import SHARDS_KEY

__all__ = []


class _Records:
    """torch's zip-reader shape over a mapped file: small records verified as they
    are read, storages unread (their tensors remembered, to verify them when kept)."""

    def __init__(self, f, owners):
        self._f = f
        self._owners = owners

    def get_record(self, name):
        return self._f.verified(name).numpy().tobytes()

    def has_record(self, name):
        return self._f.has(name)

    def get_all_records(self):
        return self._f.names()

    def get_storage_from_record(self, name, numel, dtype):
        t = self._f.record(name)
        self._owners[t.data_ptr()] = (self._f, name)
        return t

    def serialization_id(self):
        return ""


def _tensors(values):
    stack = list(values)
    while stack:
        v = stack.pop()
        if torch.is_tensor(v):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


class Entries:
    """The records behind a loaded state, verified when a rank keeps them."""

    def __init__(self, owners):
        self._owners = owners

    def _record_of(self, t):
        return self._owners.get(t.untyped_storage().data_ptr()) if t.device.type == "cpu" \
            else None

    def check(self, values):
        """Verifies the records behind `values`' tensors; collective over the world."""
        err = None
        try:
            for t in _tensors(values):
                rec = self._record_of(t)
                if rec is not None:
                    rec[0].verify(rec[1])
        except CheckpointError as e:
            err = str(e)
        agree(err, "every rank verified the entries it keeps", world=True)

    def take(self, value):
        """`value` with every tensor over the mapping replaced by a copy (checked first)."""
        if torch.is_tensor(value):
            return value.clone() if self._record_of(value) is not None else value
        if isinstance(value, dict):
            return type(value)((k, self.take(v)) for k, v in value.items()) \
                if type(value) is not dict else {k: self.take(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.take(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.take(v) for v in value)
        return value


class StateByEntry(dict):
    """A loaded state dict whose tensors are read when kept (`smp_entries`)."""

    smp_entries = None


def _files(base, partial):
    if not partial:
        return [base]
    if _read.has_shards(base):
        return _read.shard_files(base)
    paths, _ = _C.checkpoint_resolve_partial(base)
    return paths


def load(base, partial):
    """Every entry of the save `base` (its newest complete generation of parts, its
    v3 shards, or the full file), read by entry. Collective over the world (every rank
    of resume_from_checkpoint). Returns a StateByEntry, or what the file holds when it
    is not a dict."""
    owners, objs, err = {}, [], None
    try:
        if not partial and not os.path.exists(base):
            raise CheckpointError(f"smp: checkpoint '{base}' does not exist")
        for path in _files(base, partial):
            if not _C.checkpoint_has_manifest(path) or \
                    _C.checkpoint_read_manifest(path).entry_chunk == 0:
                # a version 1 file, or a plain torch.save one (a Hugging Face
                # pytorch_model.bin): read whole, as smp.load does

                objs.append(_read.read_full(path, None, pickle, False, {}))
                continue
            f = _C.CheckpointFile(path)
            objs.append(_read.unpickle_records(_Records(f, owners), path))
    except CheckpointError as e:
        err = str(e)
    agree(err, "every rank opened the checkpoint's parts", world=True)
    merged = _parts.merge(objs)
    if not isinstance(merged, dict):
        return merged
    out = StateByEntry(merged)
    out.pop(PARTIAL_KEY, None)  # every part is in: a complete state
    out.pop(SHARDS_KEY, None)
    out.smp_entries = Entries(owners)
    return out
