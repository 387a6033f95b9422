"""`smp.save`, `smp.load`, `smp.save_checkpoint`, `smp.resume_from_checkpoint`.

The file layer is C++ (`checkpoint/`, bound as `smp._C.checkpoint_*`): sealing a file
(hash, manifest in the zip comment, fsync), the atomic rename, reading and verifying
every byte, and choosing the newest complete generation of a partial save. This module
presents SMP v1's API on top: torch.save produces the zip, and a verified file is
unpickled with torch's own loader from the records C++ read (one read of the file).

Partial checkpoints are keyed by name, so they reshard: a job with pp_size B reads the
A parts of a save (each rank the parts that hold its layers, see `_my_parts`), and
`DistributedModel.load_state_dict` / `DistributedOptimizer.load_state_dict` move what
each rank owns from the rank that read it. See docs/checkpoint.md.
"""
import copy
import os
import pickle
import random
import shutil
import time

import torch

from smp import _C, agreement, core
from smp.checkpoint import _torch_load

__all__ = []

CheckpointError = _C.CheckpointError

_PARTIAL_KEY = "_smp_is_partial"


# --- helpers ----------------------------------------------------------------------------

def _check_path(name, f):
    if not isinstance(f, (str, os.PathLike)):
        raise ValueError(f"smp: {name} f={f!r} is not a path (allowed: str or os.PathLike; "
                         "SMP accepts only file names)")
    return os.fspath(f)


def _check_bool(fn, name, value):
    if not isinstance(value, bool):
        raise ValueError(f"smp.{fn}: argument '{name}'={value!r} is not one of {{True, False}}")


def _topology():
    if core.is_initialized():
        return core.pp_rank(), core.pp_size(), core.dp_rank(), core.dp_size(), core.size()
    return 0, 1, 0, 1, 1


def _manifest(partial, part, parts, save_id, save_time_ns):
    _, pp, _, dp, world = _topology()
    m = _C.Manifest()
    m.save_id, m.save_time_ns = save_id, save_time_ns
    m.partial, m.part, m.parts = partial, part, parts
    m.world_size, m.pp_size, m.dp_size = world, pp, dp
    model = core.state.model if core.is_initialized() else None
    m.plan_hash = getattr(model, "_plan_hash", 0) or 0
    m.torch_version = torch.__version__
    return m


def _agree(error, what):
    """Raises on every pp-group member the first member's `error` (a str, or None).

    `what` names the agreement point for readers of this code, not for users: the
    message is the error itself, plus which pp ranks hit it when not all of them did
    (the same text on every rank).
    """
    agreement.agree(None if error is None else CheckpointError(error),
                    core.CommGroup.PP_GROUP, _verdict)


def _verdict(failures, size):
    _, _, msg = failures[0]
    same = [r for r, _, text in failures if text == msg]
    if len(same) < size:
        msg = f"{msg} (pp rank{'s' if len(same) > 1 else ''} {', '.join(map(str, same))})"
    return CheckpointError(msg)


def _missing_directory(fn, path):
    """The user's message when `path`'s directory does not exist, else None."""
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(d):
        return None
    return (f"smp.{fn}: directory '{d}' does not exist (saving '{path}'): create it before "
            f"saving (os.makedirs('{d}', exist_ok=True) on one rank, then smp.barrier()), "
            "or pass a file name in an existing directory")


# --- pickling of comm hooks and their states ---------------------------------------------
# Built-in hooks are module-level Python functions (smp/ddp_comm_hooks/_builtin.py):
# they pickle by reference as any function does. A hook state's process group never
# enters a file: states drop it (`__getstate__`) or, when they do not, a copy with
# `process_group=None` is saved; on load smp's dp group is put back
# (see _rebind_comm_hook_state).

def _strip_comm_hook_state(obj):
    if isinstance(obj, dict) and "comm_hook_state" in obj:
        state = obj["comm_hook_state"]
        own_getstate = getattr(type(state), "__getstate__", None) not in (
            None, getattr(object, "__getstate__", None))
        if getattr(state, "process_group", None) is not None and not own_getstate:
            state = copy.copy(state)
            state.process_group = None
            obj = dict(obj)
            obj["comm_hook_state"] = state
    return obj


def _rebind_comm_hook_state(obj):
    if isinstance(obj, dict) and "comm_hook_state" in obj and core.is_initialized():
        state = obj["comm_hook_state"]
        if hasattr(state, "process_group") and state.process_group is None:
            try:
                state.process_group = core.get_dp_process_group()
            except AttributeError:
                pass
    return obj


def _crash_point(stage):
    """Fault injection for tests: SMP_CHECKPOINT_CRASH_AT="<stage>:<pp rank>" SIGKILLs
    that rank at that moment of a partial save (tests/python/test_checkpoint.py)."""
    want = os.environ.get("SMP_CHECKPOINT_CRASH_AT")
    if want and want == f"{stage}:{_topology()[0]}":
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


# --- writing ------------------------------------------------------------------------------

def _tmp_path(final):
    d, base = os.path.split(os.path.abspath(final))
    return os.path.join(d, f".{base}.tmp-{os.getpid()}-{random.getrandbits(48):012x}")


def _write_sealed(obj, final, manifest, pickle_module, pickle_protocol):
    """torch.save into a temporary beside `final`, sealed by C++. Returns its path."""
    tmp = _tmp_path(final)
    try:
        torch.save(obj, tmp, pickle_module=pickle_module, pickle_protocol=pickle_protocol)
        if manifest.partial:
            _crash_point("after_write")
        _C.checkpoint_seal(tmp, manifest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return tmp


@core.api_call("smp.save()")  # Note [Naming the call] in smp/core.py
def save(obj, f, partial=True, pickle_module=pickle, pickle_protocol=2, v3=False, **kwargs):
    """Saves `obj` atomically to `f` (full) or `f"{f}_{pp_rank}"` (partial).

    Args:
        obj: what to save (typically a dict of state dicts).
        f: a file name. The directory must exist.
        partial: True: every rank of the pp group (the ranks with dp_rank() == 0; other
            dp ranks skip the write, so they may call too) writes its part; the call is
            collective over the pp group. False: the calling rank writes `f` alone.
        pickle_module, pickle_protocol: as torch.save.
        v3: accepted for SMP 1.10 compatibility (tensor parallelism is not sharded here).

    Raises:
        CheckpointError: a part could not be written (raised on every rank of the group);
            `f`'s directory does not exist (on every rank that calls, the same message).
        ValueError: a bad argument.
    """
    path = _check_path("save", f)
    _check_bool("save", "partial", partial)
    _check_bool("save", "v3", bool(v3) if v3 in (0, 1) else v3)
    if kwargs:
        raise ValueError(f"smp.save: unexpected arguments {sorted(kwargs)} (allowed: partial, "
                         "pickle_module, pickle_protocol, v3)")
    obj = _strip_comm_hook_state(obj)
    pp_rank, pp_size, dp_rank, _, _ = _topology()
    missing = _missing_directory("save", path)
    if missing and (not partial or dp_rank != 0):
        raise CheckpointError(missing)  # the writers below agree on it first
    if not partial:
        m = _manifest(False, 0, 1, random.getrandbits(63), time.time_ns())
        tmp = _write_sealed(obj, path, m, pickle_module, pickle_protocol)
        _C.checkpoint_publish(tmp, path, False)
        return
    if dp_rank != 0:
        return  # dp replicas hold the same state; dp rank 0's pp group writes it
    save_id, t_ns = (random.getrandbits(63), time.time_ns())
    if pp_size > 1:
        save_id, t_ns = core.allgather((save_id, t_ns), core.CommGroup.PP_GROUP)[0]
    final = f"{path}_{pp_rank}"
    tmp, err = None, missing
    try:
        if err is None:
            tmp = _write_sealed(obj, final, _manifest(True, pp_rank, pp_size, save_id, t_ns),
                                pickle_module, pickle_protocol)
    except Exception as e:  # noqa: BLE001  (reported on every rank below)
        err = f"smp.save: writing '{final}' failed on pp rank {pp_rank}: {e}"
    _crash_point("after_seal")
    try:
        _agree(err, "every part sealed before any is renamed")
    except CheckpointError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise
    # See Note [Generations] in checkpoint/checkpoint.cpp.
    err = None
    _crash_point("before_rename")
    try:
        _C.checkpoint_publish(tmp, final, True)
    except Exception as e:  # noqa: BLE001
        err = f"smp.save: renaming '{final}' failed on pp rank {pp_rank}: {e}"
    _crash_point("after_rename")
    _agree(err, "every part renamed")
    _C.checkpoint_drop_previous(final)


# --- reading ------------------------------------------------------------------------------

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
    ours = (" It holds smp objects (a comm hook or its state, such as PowerSGDState), which "
            "weights_only=True refuses as torch.load refuses torch's own PowerSGDState."
            if "smp." in reason else "")
    return CheckpointError(
        f"smp.load: '{path}' holds objects that weights_only=True refuses: it loads tensors, "
        "plain containers and numbers only (and what torch.serialization.add_safe_globals "
        f"allows).{ours} Pass weights_only=False only for a file you trust. "
        f"torch's reason: {reason}")


def _unpickle(records, map_location, pickle_module, pickle_load_args, weights_only=False,
              path=None):
    try:
        return _torch_load.unpickle(_Records(records), map_location, pickle_module,
                                    weights_only, pickle_load_args)
    except _torch_load.WeightsOnlyRefused as e:
        raise _refused(path, str(e)) from None


def _load_full(path, map_location, pickle_module, weights_only, pickle_load_args):
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
    _, records = _C.checkpoint_read_verified(path)
    return _unpickle(records, map_location, pickle_module, pickle_load_args, weights_only, path)


def _my_parts(parts, pp_rank, pp_size):
    """The parts of an A-part save this rank reads: contiguous blocks, so with a
    pipeline's layer order the parts a rank reads mostly hold the layers it owns."""
    if pp_size >= parts:
        return [pp_rank * parts // pp_size]
    return [p for p in range(parts) if p * pp_size // parts == pp_rank]


def _merge(objs):
    """Merges what several parts of one save hold: dicts by key (recursively), optimizer
    param groups by index; any other value is taken from the first part."""
    if len(objs) == 1:
        return objs[0]
    if all(isinstance(o, dict) for o in objs):
        out, keys, seen = {}, [], set()
        for o in objs:
            for k in o:
                if k not in seen:
                    seen.add(k)
                    keys.append(k)
        for k in keys:
            vals = [o[k] for o in objs if k in o]
            if k == "param_groups" and all(isinstance(v, list) for v in vals):
                out[k] = _merge_param_groups(vals)
            elif k == _PARTIAL_KEY:
                out[k] = any(vals)
            else:
                out[k] = _merge(vals) if all(isinstance(v, dict) for v in vals) else vals[0]
        return out
    return objs[0]


def _merge_param_groups(lists):
    n = max(len(lst) for lst in lists)
    out = []
    for i in range(n):
        groups = [lst[i] for lst in lists if i < len(lst)]
        g = dict(groups[0])
        params = []
        for h in groups:
            params.extend(p for p in h.get("params", []) if p not in params)
        g["params"] = params
        out.append(g)
    return out


@core.api_call("smp.load()")
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
    path = _check_path("load", f)
    _check_bool("load", "partial", partial)
    mmap = pickle_load_args.pop("mmap", None)
    if mmap:
        raise ValueError(f"smp.load: argument 'mmap'={mmap!r} is not "
                         "supported (smp verifies every byte it reads into memory; use "
                         "torch.load(..., mmap=True) on a full file)")
    weights_only = _torch_load.resolve_weights_only("load", weights_only, pickle_module)
    if not partial:
        return _rebind_comm_hook_state(_load_full(path, map_location, pickle_module,
                                                  weights_only, pickle_load_args))
    pp_rank, pp_size, _, _, _ = _topology()
    err, paths, got = None, None, []
    try:
        paths, _ = _C.checkpoint_resolve_partial(path)
        for p in _my_parts(len(paths), pp_rank, pp_size):
            got.append(_C.checkpoint_read_verified(paths[p])[1])
    except CheckpointError as e:
        err = str(e)
    _agree(err, "verifying the partial checkpoint")
    objs = []
    try:
        for p, r in zip(_my_parts(len(paths), pp_rank, pp_size), got):
            objs.append(_unpickle(r, map_location, pickle_module, pickle_load_args,
                                  weights_only, paths[p]))
    except CheckpointError as e:  # a weights-only refusal: parts differ, so agree on it
        err = str(e)
    _agree(err, "unpickling the partial checkpoint")
    return _rebind_comm_hook_state(_merge(objs))


# --- save_checkpoint / resume_from_checkpoint (SMP 1.10) ---------------------------------

_NEWEST = "newest"


def _partial_dir(path, tag):
    return os.path.join(path, f"{tag}_partial")


@core.api_call("smp.save_checkpoint()")
def save_checkpoint(path, tag, partial=True, model=None, optimizer=None, user_content=None,
                    translate_if_full=True, num_kept_partial_checkpoints=None):
    """Saves model, optimizer and user content under `path` (SMP 1.10).

    partial=True: directory `path/{tag}_partial` with `model_{pp_rank}`,
    `optimizer_{pp_rank}` and `user_content` parts (smp.save partial files); then
    `path/newest` names the tag (written last, atomically); with
    `num_kept_partial_checkpoints=N` only the N newest partial directories remain.
    partial=False: `path/{tag}` holds the full model state dict (plain keys, loadable
    with torch.load into the unwrapped module), `path/{tag}.optimizer` and
    `path/user_content_{tag}`. Call on every rank.

    Raises:
        ValueError: a bad argument. CheckpointError: a write failed (every rank).
    """
    path = _check_path("save_checkpoint", path)
    _check_bool("save_checkpoint", "partial", partial)
    if not isinstance(tag, str) or not tag or "/" in tag or tag == _NEWEST:
        raise ValueError(f"smp.save_checkpoint: tag={tag!r} is not a non-empty name without '/' "
                         f"(and not '{_NEWEST}')")
    if num_kept_partial_checkpoints is not None and (
            not isinstance(num_kept_partial_checkpoints, int) or num_kept_partial_checkpoints < 1):
        raise ValueError("smp.save_checkpoint: num_kept_partial_checkpoints="
                         f"{num_kept_partial_checkpoints!r} is not None or an integer >= 1")
    model = model if model is not None else core.state.model
    optimizer = optimizer if optimizer is not None else core.state.optimizer
    if core.is_initialized() and core.rank() == 0:
        os.makedirs(path, exist_ok=True)
    if partial:
        d = _partial_dir(path, tag)
        if core.is_initialized() and core.rank() == 0:
            os.makedirs(d, exist_ok=True)
        core.barrier() if core.is_initialized() else None
        if model is not None:
            save(model.local_state_dict(), os.path.join(d, "model"), partial=True)
        if optimizer is not None:
            save(optimizer.local_state_dict(), os.path.join(d, "optimizer"), partial=True)
        save({"user_content": user_content, "tag": tag}, os.path.join(d, "user_content"),
             partial=True)
        if core.is_initialized():
            core.barrier()
        if not core.is_initialized() or core.rank() == 0:
            _C.checkpoint_write_file_atomic(os.path.join(path, _NEWEST), tag.encode())
            if num_kept_partial_checkpoints is not None:
                _prune(path, num_kept_partial_checkpoints)
        if core.is_initialized():
            core.barrier()
        return
    sd = model.state_dict(gather_to_rank0=True) if model is not None else None
    osd = optimizer.state_dict(gather_to_rank0=True) if optimizer is not None else None
    if not core.is_initialized() or core.rank() == 0:
        if sd is not None:
            save(sd, os.path.join(path, tag), partial=False)
        if osd is not None:
            save(osd, os.path.join(path, f"{tag}.optimizer"), partial=False)
        save({"user_content": user_content, "tag": tag},
             os.path.join(path, f"user_content_{tag}"), partial=False)
    if core.is_initialized():
        core.barrier()


def _prune(path, keep):
    dirs = []
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.endswith("_partial") and os.path.isdir(full):
            dirs.append((os.stat(full).st_mtime_ns, name, full))
    for _, _, full in sorted(dirs, reverse=True)[keep:]:
        shutil.rmtree(full, ignore_errors=True)


@core.api_call("smp.resume_from_checkpoint()")
def resume_from_checkpoint(path, tag=None, partial=True, strict=True, load_optimizer=True,
                           load_sharded_optimizer_state=True, translate_function=None):
    """Loads what save_checkpoint wrote (SMP 1.10); returns the user content.

    tag=None reads `path/newest`. With partial=False, `path/tag` may also be a plain
    torch.save'd full model state dict (Hugging Face's `pytorch_model.bin`). Model and
    optimizer states load into smp's DistributedModel / DistributedOptimizer (deferred
    to after partitioning when called before the first step). Call on every rank.

    Raises:
        CheckpointError: missing, damaged or mixed files (every rank).
        ValueError: a bad argument.
    """
    path = _check_path("resume_from_checkpoint", path)
    _check_bool("resume_from_checkpoint", "partial", partial)
    if tag is None:
        newest = os.path.join(path, _NEWEST)
        if not os.path.exists(newest):
            raise CheckpointError(f"smp: resume_from_checkpoint: '{newest}' does not exist and no "
                                  "tag was given")
        with open(newest) as fh:
            tag = fh.read().strip()
    model, optimizer = core.state.model, core.state.optimizer
    if partial:
        d = _partial_dir(path, tag)
        if not os.path.isdir(d):
            raise CheckpointError(f"smp: resume_from_checkpoint: partial checkpoint directory "
                                  f"'{d}' does not exist")
        content = load(os.path.join(d, "user_content"), partial=True)
        if model is not None:
            sd = load(os.path.join(d, "model"), partial=True)
            if translate_function is not None:
                sd = translate_function(sd)
            model.load_state_dict(sd, strict=strict)
        if optimizer is not None and load_optimizer:
            optimizer.load_state_dict(load(os.path.join(d, "optimizer"), partial=True))
        return content.get("user_content") if isinstance(content, dict) else content
    sd = load(os.path.join(path, tag), partial=False)
    if translate_function is not None:
        sd = translate_function(sd)
    if model is not None:
        model.load_state_dict(sd, strict=strict)
    opt_path = os.path.join(path, f"{tag}.optimizer")
    if optimizer is not None and load_optimizer and os.path.exists(opt_path):
        optimizer.load_state_dict(load(opt_path, partial=False))
    uc = os.path.join(path, f"user_content_{tag}")
    if os.path.exists(uc):
        content = load(uc, partial=False)
        return content.get("user_content") if isinstance(content, dict) else content
    return None


# `smp.checkpoint.merge_partial` / `optimizer_to_torch` and `python -m smp.checkpoint
# merge`: the parts of a partial save as one plain state dict (docs/checkpoint.md).
from smp.checkpoint.merge import merge_partial, optimizer_to_torch  # noqa: E402,F401
