"""torch.save's pickling as smp's writer uses it, on every supported torch (1.13 to 2.x).

Note [One writer] in checkpoint/writer.cpp: smp pickles with torch's own `_save` into
records instead of a file, and C++ writes them (with torch's zip writer) while hashing.
`_save` hands each record to its `zip_file` with `write_record(name, data, nbytes)`,
where `data` is a str/bytes (the pickle, small markers) or a storage (a tensor's bytes,
moved to the CPU by `_save` itself). The records keep the storages: nothing is copied
here. torch 1.13's `_save` has no `_disable_byteorder_record` argument.
"""
import inspect
import pickle

import torch
import torch.serialization as _ser

__all__ = []

_TAKES_BYTEORDER_FLAG = "_disable_byteorder_record" in inspect.signature(_ser._save).parameters


class _Recorder:
    """Stands in for torch's PyTorchFileWriter: collects (name, uint8 CPU tensor)."""

    def __init__(self):
        self.records = []

    def write_record(self, name, data, nbytes):
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, (bytes, bytearray)):
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
                torch.empty(0, dtype=torch.uint8)
        else:  # a storage (UntypedStorage, or TypedStorage on 1.13)
            storage = data.untyped() if hasattr(data, "untyped") else data
            t = torch.empty(0, dtype=torch.uint8).set_(storage)
        assert t.numel() == nbytes, (name, t.numel(), nbytes)
        self.records.append((name, t))

    def write_record_metadata(self, name, nbytes):  # only under torch's skip_data
        raise RuntimeError("smp.save: torch.serialization.skip_data is not supported")


def records_of(obj, pickle_module=pickle, pickle_protocol=2):
    """What torch.save(obj) would write, as [(record name, uint8 CPU tensor)]; the
    tensors share the object's (CPU) storages."""
    rec = _Recorder()
    if _TAKES_BYTEORDER_FLAG:
        _ser._save(obj, rec, pickle_module, pickle_protocol, False)
    else:
        _ser._save(obj, rec, pickle_module, pickle_protocol)
    return rec.records
