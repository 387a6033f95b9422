"""`smp.save_checkpoint` and `smp.resume_from_checkpoint` (SMP 1.10): a directory of
smp.save files (model, optimizer, user content) and a `newest` file naming the tag."""
import os
import shutil

import smp._C as _C
from smp import auto_resume, log, optimizer_sharding
from smp.checkpoint import _read
from smp.checkpoint._api import load, save
from smp.checkpoint._common import CheckpointError, check_bool, check_path
from smp.collectives import api_call, barrier
from smp.process_state import is_initialized, state
from smp.ranks import rank

__all__ = []

_NEWEST = "newest"


def _partial_dir(path, tag):
    return os.path.join(path, f"{tag}_partial")


@api_call("smp.save_checkpoint()")
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
    path = check_path("save_checkpoint", path)
    check_bool("save_checkpoint", "partial", partial)
    if not isinstance(tag, str) or not tag or "/" in tag or tag == _NEWEST:
        raise ValueError(f"smp.save_checkpoint: tag={tag!r} is not a non-empty name without '/' "
                         f"(and not '{_NEWEST}')")
    if num_kept_partial_checkpoints is not None and (
            not isinstance(num_kept_partial_checkpoints, int) or num_kept_partial_checkpoints < 1):
        raise ValueError("smp.save_checkpoint: num_kept_partial_checkpoints="
                         f"{num_kept_partial_checkpoints!r} is not None or an integer >= 1")
    if auto_resume.skip_save(path, tag):
        return  # a save the fast-forward replays (Note [Automatic resume])
    model = model if model is not None else state.model
    optimizer = optimizer if optimizer is not None else state.optimizer
    if is_initialized() and rank() == 0:
        os.makedirs(path, exist_ok=True)
    if partial:
        d = _partial_dir(path, tag)
        if is_initialized() and rank() == 0:
            os.makedirs(d, exist_ok=True)
        barrier() if is_initialized() else None
        if model is not None:
            save(model.local_state_dict(), os.path.join(d, "model"), partial=True)
        if optimizer is not None:
            if optimizer_sharding.of(optimizer) is not None:
                # Note [Sharded optimizer state]: each rank writes its own share
                # (`optimizer_{pp}_{dp}`), nothing gathered; any layout reads them.
                save(optimizer.local_state_dict(gather_if_shard=False),
                     os.path.join(d, "optimizer"), partial=True, v3=True)
            else:
                save(optimizer.local_state_dict(), os.path.join(d, "optimizer"), partial=True)
        save({"user_content": user_content, "tag": tag}, os.path.join(d, "user_content"),
             partial=True)
        auto_resume.save_progress(path, tag, partial=True)
        if is_initialized():
            barrier()
        if not is_initialized() or rank() == 0:
            _C.checkpoint_write_file_atomic(os.path.join(path, _NEWEST), tag.encode())
            if num_kept_partial_checkpoints is not None:
                _prune(path, num_kept_partial_checkpoints)
        if is_initialized():
            barrier()
        return
    sd = model.state_dict(gather_to_rank0=True) if model is not None else None
    osd = optimizer.state_dict(gather_to_rank0=True) if optimizer is not None else None
    if not is_initialized() or rank() == 0:
        if sd is not None:
            save(sd, os.path.join(path, tag), partial=False)
        if osd is not None:
            save(osd, os.path.join(path, f"{tag}.optimizer"), partial=False)
        save({"user_content": user_content, "tag": tag},
             os.path.join(path, f"user_content_{tag}"), partial=False)
    auto_resume.save_progress(path, tag, partial=False)
    if is_initialized():
        barrier()
    # The job's checkpoint directory names its newest full save too, after every part
    # is written (Note [Automatic resume]); elsewhere full saves keep SMP's layout.
    if auto_resume.is_job_dir(path):
        if not is_initialized() or rank() == 0:
            _C.checkpoint_write_file_atomic(os.path.join(path, _NEWEST), tag.encode())
        if is_initialized():
            barrier()


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
            sd = load(os.path.join(d, "model"), partial=True)
            if translate_function is not None:
                sd = translate_function(sd)
            model.load_state_dict(sd, strict=strict)
        if optimizer is not None and load_optimizer:
            opt_path = os.path.join(d, "optimizer")
            # A sharded optimizer's shares (`optimizer_{pp}_{dp}`) load like parts.
            if load_sharded_optimizer_state or not _read.has_shards(opt_path):
                optimizer.load_state_dict(load(opt_path, partial=True))
            else:
                log.get_logger().warning(
                    "smp: resume_from_checkpoint(load_sharded_optimizer_state=False): "
                    "'%s' holds a sharded optimizer state (shares '%s_<pp>_<dp>'); "
                    "the optimizer starts fresh", d, opt_path)
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


