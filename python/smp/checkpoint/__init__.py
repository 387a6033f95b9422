"""`smp.save`, `smp.load`, `smp.save_checkpoint`, `smp.resume_from_checkpoint`.

The file layer is C++ (`checkpoint/`, bound as `smp._C.checkpoint_*`): sealing a file
(hash, manifest in the zip comment, fsync), the atomic rename, reading and verifying
every byte, and choosing the newest complete generation of a partial save. This package
presents SMP v1's API on top: torch.save produces the zip, and a verified file is
unpickled with torch's own loader from the records C++ read (one read of the file).

Partial checkpoints are keyed by name, so they reshard: a job with pp_size B reads the
A parts of a save (each rank the parts that hold its layers, see `_parts.my_parts`), and
`DistributedModel.load_state_dict` / `DistributedOptimizer.load_state_dict` move what
each rank owns from the rank that read it. See docs/checkpoint.md.

One concept per module:
- `_api`: smp.save and smp.load (argument checks; full file or partial save);
- `_commit`: writing a sealed file, and the two-phase commit of a partial save;
- `_async`: asynchronous saves: staging, the writer thread's jobs, settling them;
- `_torch_save`: torch's pickling into records for C++'s writer (checkpoint/writer.h);
- `_read`: reading verified files and unpickling them, part by part;
- `_parts`: which parts a rank reads and how parts merge;
- `_resume`: save_checkpoint and resume_from_checkpoint (SMP 1.10);
- `_hook_state`: comm hook states in files (no process group inside);
- `_crash`: fault injection for the crash tests;
- `_common`: the error type, argument checks, the pp group's agreement on an error;
- `_torch_load`: torch's unpickler over records read by C++;
- `merge` (and `python -m smp.checkpoint merge`): a partial save as one plain file;
- `dcp` (and `python -m smp.checkpoint to-dcp` / `from-dcp`): `to_dcp` and `from_dcp`,
  interchange with torch.distributed.checkpoint, model and optimizer state.
"""
from smp.checkpoint._api import load, save  # noqa: F401  (the package's names)
from smp.checkpoint._async import SaveFuture  # noqa: F401
from smp.checkpoint._common import CheckpointError  # noqa: F401
from smp.checkpoint._resume import resume_from_checkpoint, save_checkpoint  # noqa: F401

__all__ = []

# `smp.checkpoint.merge_partial` / `optimizer_to_torch` and `python -m smp.checkpoint
# merge`: the parts of a partial save as one plain state dict (docs/checkpoint.md).
from smp.checkpoint.merge import merge_partial, optimizer_to_torch  # noqa: E402,F401


def __getattr__(name):
    """`smp.checkpoint.to_dcp` / `from_dcp` (dcp.py), imported when first used."""
    if name in ("to_dcp", "from_dcp"):
        # Note [DCP imported when used] in dcp.py: `import smp` stays as cheap as before.
        from smp.checkpoint import dcp
        return getattr(dcp, name)
    raise AttributeError(f"module 'smp.checkpoint' has no attribute {name!r}")
