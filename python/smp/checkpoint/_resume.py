"""`smp.save_checkpoint` and `smp.resume_from_checkpoint` (SMP 1.10): a directory of
smp.save files (model, optimizer, user content) and a `newest` file naming the tag."""
import os
import shutil

import smp._C as _C
from smp import auto_resume, log, optimizer_sharding
from smp.checkpoint import _async, _entries, _read
from smp.checkpoint._api import load, save
from smp.checkpoint._common import CheckpointError, check_bool, check_path
from smp.collectives import api_call, barrier
from smp.groups import CommGroup
from smp.process_state import is_initialized, state
from smp.ranks import rank

__all__ = []

_NEWEST = "newest"


def _partial_dir(path, tag):
    return os.path.join(path, f"{tag}_partial")


@api_call("smp.save_checkpoint()")
def save_checkpoint(path, tag, partial=True, model=None, optimizer=None, user_content=None,
                    translate_if_full=True, num_kept_partial_checkpoints=None, *,
                    async_save=False):
    """Saves model, optimizer and user content under `path` (SMP 1.10).

    partial=True: directory `path/{tag}_partial` with `model_{pp_rank}`,
    `optimizer_{pp_rank}` and `user_content` parts (smp.save partial files); then
    `path/newest` names the tag (written last, atomically); with
    `num_kept_partial_checkpoints=N` only the N newest partial directories remain.
    partial=False: `path/{tag}` holds the full model state dict (plain keys, loadable
    with torch.load into the unwrapped module; under tensor parallelism the tp slices
    gathered into full tensors, and with `translate_if_full` a model substituted from
    Hugging Face's in Hugging Face's names), `path/{tag}.optimizer` and
    `path/user_content_{tag}`. Call on every rank. Under tensor parallelism a partial
    save has a part per (pp rank, tp rank), `model_{pp_rank * tp_size + tp_rank}`
    (Note [Slices in checkpoints] in smp/tp_state.py).
    async_save=True: returns an `smp.checkpoint.SaveFuture` once the state is staged;
    the files are written in the background, and `newest` moves to the tag only when
    every rank's files are committed (Note [Asynchronous save] in _async.py).

    Raises:
        ValueError: a bad argument. CheckpointError: a write failed (every rank).
    """
    path = check_path("save_checkpoint", path)
    check_bool("save_checkpoint", "partial", partial)
    _async.check_flag("save_checkpoint", async_save)
    if not isinstance(tag, str) or not tag or "/" in tag or tag == _NEWEST:
        raise ValueError(f"smp.save_checkpoint: tag={tag!r} is not a non-empty name without '/' "
                         f"(and not '{_NEWEST}')")
    if num_kept_partial_checkpoints is not None and (
            not isinstance(num_kept_partial_checkpoints, int) or num_kept_partial_checkpoints < 1):
        raise ValueError("smp.save_checkpoint: num_kept_partial_checkpoints="
                         f"{num_kept_partial_checkpoints!r} is not None or an integer >= 1")
    _async.settle()
    if auto_resume.skip_save(path, tag):
        return None  # a save the fast-forward replays (Note [Automatic resume])
    model = model if model is not None else state.model
    optimizer = optimizer if optimizer is not None else state.optimizer
    if not async_save:
        _write_checkpoint(path, tag, partial, model, optimizer, user_content, False,
                          translate_if_full)
        _name_newest(path, tag, partial, num_kept_partial_checkpoints)
        return None
    group = CommGroup.WORLD if is_initialized() else None
    with _async.collect("smp.save_checkpoint(async_save=True)", group) as pending:
        _write_checkpoint(path, tag, partial, model, optimizer, user_content, True,
                          translate_if_full)
        _async.commit(pending, lambda: _name_newest(path, tag, partial,
                                                    num_kept_partial_checkpoints))
    return _async.SaveFuture(pending)


def _write_checkpoint(path, tag, partial, model, optimizer, user_content, async_save,
                      translate_if_full=True):
    """save_checkpoint's files (every rank calls)."""
    if is_initialized() and rank() == 0:
        os.makedirs(path, exist_ok=True)
    if partial:
        d = _partial_dir(path, tag)
        if is_initialized() and rank() == 0:
            os.makedirs(d, exist_ok=True)
        barrier() if is_initialized() else None
        if model is not None:
            save(model.local_state_dict(), os.path.join(d, "model"), partial=True,
                 async_save=async_save)
        if optimizer is not None:
            if optimizer_sharding.of(optimizer) is not None:
                # Note [Sharded optimizer state]: each rank writes its own share
                # (`optimizer_{pp}_{dp}`), nothing gathered; any layout reads them.
                save(optimizer.local_state_dict(gather_if_shard=False),
                     os.path.join(d, "optimizer"), partial=True, v3=True,
                     async_save=async_save)
            else:
                save(optimizer.local_state_dict(), os.path.join(d, "optimizer"), partial=True,
                     async_save=async_save)
        save({"user_content": user_content, "tag": tag}, os.path.join(d, "user_content"),
             partial=True, async_save=async_save)
        auto_resume.save_progress(path, tag, partial=True)
        return
    # Full tensors: under tp the slices are gathered (Note [Slices in checkpoints] in
    # smp/tp_state.py), then, with translate_if_full, named as the model substituted
    # from (SMP 1.10: Hugging Face's names, through its registered translations).
    sd = model.state_dict(gather_to_rank0=True) if model is not None else None
    osd = optimizer.state_dict(gather_to_rank0=True) if optimizer is not None else None
    if not is_initialized() or rank() == 0:
        if sd is not None and translate_if_full:
            for smp_to_hf, _ in state.module_manager.translate_functions:
                sd = smp_to_hf(sd)
        if sd is not None:
            save(sd, os.path.join(path, tag), partial=False, async_save=async_save)
        if osd is not None:
            save(osd, os.path.join(path, f"{tag}.optimizer"), partial=False,
                 async_save=async_save)
        save({"user_content": user_content, "tag": tag},
             os.path.join(path, f"user_content_{tag}"), partial=False, async_save=async_save)
    auto_resume.save_progress(path, tag, partial=False)


def _name_newest(path, tag, partial, keep):
    """After every rank's files are committed: `newest` names the tag (partial saves,
    and full saves in the job's own directory: Note [Automatic resume]; elsewhere full
    saves keep SMP's layout), then old partial directories go. Collective (barriers)."""
    if not partial and not auto_resume.is_job_dir(path):
        if is_initialized():
            barrier()
        return
    if is_initialized():
        barrier()
    if not is_initialized() or rank() == 0:
        _C.checkpoint_write_file_atomic(os.path.join(path, _NEWEST), tag.encode())
        if partial and keep is not None:
            _prune(path, keep)
    if is_initialized():
        barrier()


def _model_state(base, partial, translate_function):
    """The model's saved state, read by entry (Note [Reads by entry]: each rank reads
    and verifies only what it keeps); through `translate_function`, read whole."""
    if translate_function is None:
        return _entries.load(base, partial)
    return translate_function(load(base, partial=partial))


def _prune(path, keep):
    dirs = []
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.endswith("_partial") and os.path.isdir(full):
            dirs.append((os.stat(full).st_mtime_ns, name, full))
    for _, _, full in sorted(dirs, reverse=True)[keep:]:
        shutil.rmtree(full, ignore_errors=True)


@api_call("smp.resume_from_checkpoint()")
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
    path = check_path("resume_from_checkpoint", path)
    check_bool("resume_from_checkpoint", "partial", partial)
    _async.settle()
    if tag is None:
        newest = os.path.join(path, _NEWEST)
        if not os.path.exists(newest):
            raise CheckpointError(f"smp: resume_from_checkpoint: '{newest}' does not exist and no "
                                  "tag was given")
        with open(newest) as fh:
            tag = fh.read().strip()
    model, optimizer = state.model, state.optimizer
    if partial:
        d = _partial_dir(path, tag)
        if not os.path.isdir(d):
            raise CheckpointError(f"smp: resume_from_checkpoint: partial checkpoint directory "
                                  f"'{d}' does not exist")
        content = load(os.path.join(d, "user_content"), partial=True)
        if model is not None:
            model.load_state_dict(_model_state(os.path.join(d, "model"), True,
                                               translate_function), strict=strict)
        if optimizer is not None and load_optimizer:
            opt_path = os.path.join(d, "optimizer")
            # A sharded optimizer's shares (`optimizer_{pp}_{dp}`) load like parts.
            if load_sharded_optimizer_state or not _read.has_shards(opt_path):
                optimizer.load_state_dict(_entries.load(opt_path, True))
            else:
                log.get_logger().warning(
                    "smp: resume_from_checkpoint(load_sharded_optimizer_state=False): "
                    "'%s' holds a sharded optimizer state (shares '%s_<pp>_<dp>'); "
                    "the optimizer starts fresh", d, opt_path)
        return content.get("user_content") if isinstance(content, dict) else content
    if model is not None:
        model.load_state_dict(_model_state(os.path.join(path, tag), False, translate_function),
                              strict=strict)
    opt_path = os.path.join(path, f"{tag}.optimizer")
    if optimizer is not None and load_optimizer and os.path.exists(opt_path):
        optimizer.load_state_dict(_entries.load(opt_path, False))
    uc = os.path.join(path, f"user_content_{tag}")
    if os.path.exists(uc):
        content = load(uc, partial=False)
        return content.get("user_content") if isinstance(content, dict) else content
    return None


