"""torch's unpickling as `smp.load` uses it, on every supported torch (1.13 to 2.x).

The one place where smp's Python meets torch.load's version differences (Note [smp.load
and weights_only]):
- torch >= 2.6's `torch.load` defaults to `weights_only=True` when no `pickle_module` is
  given (1.13: `False`); `TORCH_FORCE_WEIGHTS_ONLY_LOAD` / `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`
  override the choice as in torch.
- torch 2.x's `torch.serialization._load` takes `weights_only` as a keyword; 1.13's hands
  every keyword to the unpickler.
- a refusal of the weights-only unpickler is a `RuntimeError` in 1.13, a
  `pickle.UnpicklingError` in 2.x.
"""
import inspect
import os
import pickle
import re
import zipfile

import torch
import torch.serialization as _ser

__all__ = []

# Note [smp.load and weights_only]: smp.load unpickles a verified file with torch's own
# loader (`_load` on the records C++ read), so torch.load's `weights_only` has to be
# honoured here: under torch 2.x a `weights_only=True` given to smp.load used to reach
# `_load` as a bare flag while the file was unpickled with full pickle, silently. The
# choice follows torch.load's rules with smp's signature: SMP v1's default
# `pickle_module=pickle` is an explicit pickle module, for which torch.load also unpickles
# everything (checkpoints carry optimizer state, user content, comm hook states).
# `weights_only=True` (or `pickle_module=None` on torch >= 2.6) unpickles with torch's
# weights-only unpickler: tensors, plain containers and numbers, plus what the user allows
# with `torch.serialization.add_safe_globals`. smp's comm hooks and PowerSGDState are on
# that list (Note [Hook state loads weights-only] in smp/ddp_comm_hooks/_safe.py);
# torch's own PowerSGDState is refused there.

_DEFAULT_WEIGHTS_ONLY = torch.__version__ >= "2.6"
_LOAD_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(_ser._load).parameters
_TRUE = ("1", "y", "yes", "true")


class WeightsOnlyRefused(Exception):
    """torch's weights-only unpickler refused the file; str() is torch's reason."""


def _env(name):
    return os.environ.get(name, "0").lower() in _TRUE


def resolve_weights_only(fn, weights_only, pickle_module):
    """torch.load's choice of unpickler for `smp.<fn>(weights_only=..., pickle_module=...)`.

    Returns:
        True for torch's weights-only unpickler, False for `pickle_module`'s.

    Raises:
        ValueError: weights_only is not None/True/False, or weights-only unpickling is
            chosen with a pickle_module other than pickle or None.
    """
    if not (weights_only is None or isinstance(weights_only, bool)):
        raise ValueError(f"smp.{fn}: argument 'weights_only'={weights_only!r} is not one of "
                         "{None, True, False}")
    if _env("TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        chosen, why = True, "TORCH_FORCE_WEIGHTS_ONLY_LOAD is set"
    elif weights_only is None:
        chosen = pickle_module is None and _DEFAULT_WEIGHTS_ONLY and \
            not _env("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
        why = f"pickle_module=None under torch {torch.__version__}"
    else:
        chosen, why = weights_only, "weights_only=True"
    if chosen and pickle_module not in (None, pickle):
        raise ValueError(f"smp.{fn}: {why} (torch's weights-only unpickler), but "
                         f"pickle_module={pickle_module!r} is not the default pickle or None")
    return chosen


def unpickle(zip_reader, map_location, pickle_module, weights_only, load_args):
    """torch's `_load` on `zip_reader` (an object with torch's zip-reader methods).

    Raises:
        WeightsOnlyRefused: weights_only and the weights-only unpickler refused.
    """
    args = dict(load_args)
    args.setdefault("encoding", "utf-8")  # as torch.load
    if _LOAD_TAKES_WEIGHTS_ONLY:
        args["weights_only"] = weights_only
    if not weights_only:
        return _ser._load(zip_reader, map_location, pickle_module or pickle, **args)
    try:
        return _ser._load(zip_reader, map_location, torch._weights_only_unpickler, **args)
    except (pickle.UnpicklingError, RuntimeError) as e:  # RuntimeError: torch 1.13
        raise WeightsOnlyRefused(str(e)) from None


# Note [Mapped loads]: a zip file read to CPU is mapped (torch.load's mmap, torch >=
# 2.1) rather than read: its tensors' pages are read only when touched, so a rank that
# copies the tensors of its own partition out of a full checkpoint never reads, or
# holds, the others' (docs/memory.md). The mapping is private: writing to a loaded
# tensor copies that page and leaves the file alone.
_LOAD_TAKES_MMAP = "mmap" in inspect.signature(torch.load).parameters


def _mapped(path, map_location, load_args):
    if "mmap" in load_args or not _LOAD_TAKES_MMAP or not zipfile.is_zipfile(path):
        return load_args
    if map_location is not None and str(map_location) != "cpu":
        return load_args
    return dict(load_args, mmap=True)


def maps(path, map_location, load_args):
    """Whether load_plain maps `path` rather than reading it."""
    return "mmap" in _mapped(path, map_location, load_args)


def load_plain(path, map_location, pickle_module, weights_only, load_args):
    """torch.load of a plain torch.save file with the resolved choice, mapped where it
    can be (Note [Mapped loads]).

    Raises:
        WeightsOnlyRefused: weights_only and the weights-only unpickler refused.
    """
    load_args = _mapped(path, map_location, load_args)
    if not weights_only:
        return torch.load(path, map_location=map_location, pickle_module=pickle_module or pickle,
                          weights_only=False, **load_args)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, **load_args)
    except pickle.UnpicklingError as e:
        raise WeightsOnlyRefused(re.sub(r"\x1b\[[0-9;]*m", "", str(e))) from None  # torch's bold
