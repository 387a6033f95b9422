"""Restarts that resume by themselves (docs/checkpoint.md, "Automatic resume").

Note [Automatic resume]
A job given a checkpoint directory (config 'checkpoint_dir', or smprun's
--checkpoint_dir, which sets SMP_CHECKPOINT_DIR) continues from the newest complete
checkpoint that smp.save_checkpoint wrote there. This happens whether the job was
restarted by `smprun --max_restarts` after a rank failed, or started again by the
scheduler. The user's script needs no resume code: it calls save_checkpoint, and it
runs its loop from the start.

"Complete" is what DIR/newest names. save_checkpoint rewrites that file last, atomically
and after every rank's parts are written, so a save that a crash interrupted leaves the
previous checkpoint in use.

Beside its model and optimizer parts, every checkpoint holds one progress record per
rank (progress_<rank>):
  - the number of smp.step calls and optimizer steps this rank had made;
  - its random states (torch, CUDA, Python's random, NumPy);
  - the state of the comm hook registered on the model (PowerSGD's error feedback,
    memories and generator: each dp rank's own), and the reducer's buckets, which
    that state is indexed by (the resumed reducer adopts them, with no rebuild);
  - the shape of a step's outputs.
On a start that finds a checkpoint, smp fast-forwards:
  - the first smp.step call loads the checkpoint, as resume_from_checkpoint(DIR) would
    (the model and optimizer states land when the model is partitioned);
  - that many step calls then return without computing: outputs of the recorded shape,
    filled with NaN. That many optimizer.step() calls do nothing. The script's own loop
    meanwhile consumes its data exactly as before, which is how the data position is
    restored (as Hugging Face's Trainer skips batches);
  - the random states are restored where the checkpoint was taken. That is the
    script's save_checkpoint call with the resumed tag, which is itself skipped (the
    checkpoint exists), or, if the script does not reach it, the next real step.
From there the run is the uninterrupted one, bit for bit, provided the script's data
order does not depend on random numbers drawn inside the skipped steps. A
DistributedSampler, or a loader seeded per epoch, is such an order. A RandomSampler
without a generator draws its seed from the global generator and is not; the
docs say so.
"""
import os
import pickle
import random
import sys

import torch

import smp._C as _C
from smp import log, process_state

__all__ = []

_PROGRESS = "progress_{rank}"


class _State:
    def __init__(self):
        self.step_calls = 0  # smp.step calls made (computed) by this process
        self.opt_steps = 0  # optimizer.step() calls made
        self.template = None  # the last computed step's per-microbatch outputs, as a shape
        self.num_mb = 1
        # Set while fast-forwarding: the checkpoint to load and reach.
        self.pending = None  # {"dir", "tag", "partial"}: loaded at the first step call
        self.target = None  # the progress record resumed from
        self.skip_steps = 0
        self.skip_opt = 0
        self.resumed_layout = None  # the checkpoint's bucket layout, for the new reducer


_s = _State()


def checkpoint_dir():
    """The job's checkpoint directory: config 'checkpoint_dir', else SMP_CHECKPOINT_DIR."""
    cfg = process_state.state.cfg
    configured = getattr(cfg, "checkpoint_dir", "") if cfg is not None else ""
    return configured or os.environ.get("SMP_CHECKPOINT_DIR", "")


def is_job_dir(path):
    ckpt = checkpoint_dir()
    return bool(ckpt) and os.path.abspath(path) == os.path.abspath(ckpt)


# ---- saving ----------------------------------------------------------------------

def _random_states():
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        states["numpy"] = np.random.get_state()
    return states


def _numpy():
    return sys.modules.get("numpy")  # only when the script uses it


def _shape_of(value):
    """What a step output looks like, without its data (tensors become their metadata)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_shape_of(v) for v in value])
    if isinstance(value, dict):
        return ("dict", [(k, _shape_of(v)) for k, v in value.items()])
    return ("none", None)


def _placeholder(shape):
    kind, meta = shape[0], shape[1]
    if kind == "tensor":
        shape_, dtype = meta, shape[2]
        if dtype.is_floating_point or dtype.is_complex:
            return torch.full(shape_, float("nan"), dtype=dtype)
        return torch.zeros(shape_, dtype=dtype)
    if kind in ("list", "tuple"):
        items = [_placeholder(s) for s in meta]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _placeholder(s) for k, s in meta}
    return None


def _registered_hook_state(model):
    hook = model.replica.comm_hook if model is not None else None
    return hook[0] if hook is not None else None


def _hook_state_of(model):
    """The registered comm hook's state as saved: its state_dict() (smp's PowerSGDState:
    error feedback, memories, its generator), else its attributes but the process group;
    None without a hook or with a process group as the state."""
    state = _registered_hook_state(model)
    if state is None or isinstance(state, torch.distributed.ProcessGroup):
        return None
    if callable(getattr(state, "state_dict", None)):
        return {"state_dict": state.state_dict()}
    return {"attributes": {k: v for k, v in vars(state).items() if k != "process_group"}}


def _restore_hook_state(model, saved):
    state = _registered_hook_state(model)
    if saved is None or state is None:
        return
    if "state_dict" in saved and callable(getattr(state, "load_state_dict", None)):
        state.load_state_dict(saved["state_dict"])
    elif "attributes" in saved:
        vars(state).update(saved["attributes"])


def _bucket_layout(model):
    reducer = model.replica.reducer if model is not None else None
    return reducer.bucket_indices() if reducer is not None else None


def adopt_layout(reducer):
    """When the reducer of a resumed job is made: the buckets it had at the checkpoint
    (a comm hook keeps state per bucket index; a fresh reducer would lay its first step
    out as torch's constructor does, Note [Hook buckets follow torch's])."""
    layout = _s.resumed_layout
    _s.resumed_layout = None
    if layout is not None:
        reducer.adopt_layout(layout)


def progress_path(ckpt_dir, tag, partial, rank):
    if partial:
        return os.path.join(ckpt_dir, f"{tag}_partial", _PROGRESS.format(rank=rank))
    return os.path.join(ckpt_dir, f"{tag}.{_PROGRESS.format(rank=rank)}")


def save_progress(ckpt_dir, tag, partial):
    """Writes this rank's progress record into checkpoint `tag` (every rank, before the
    save's commit: Note [Automatic resume])."""
    record = {"step_calls": _s.step_calls, "opt_steps": _s.opt_steps, "tag": tag,
              "rng": _random_states(), "template": _s.template, "num_mb": _s.num_mb,
              "comm_hook_state": _hook_state_of(process_state.state.model),
              "bucket_layout": _bucket_layout(process_state.state.model)}
    rank = process_state.state.rank if process_state.state.initialized else 0
    _C.checkpoint_write_file_atomic(progress_path(ckpt_dir, tag, partial, rank),
                                    pickle.dumps(record, protocol=4))


def skip_save(path, tag):
    """True when a save_checkpoint call must not write: it is a call the fast-forward
    replays. The call that saved the resumed checkpoint is where its random states are
    restored."""
    if _s.target is None:
        return False
    t = _s.target
    if (os.path.abspath(path) == os.path.abspath(t["dir"]) and tag == t["tag"]
            and _s.skip_steps == 0 and _s.skip_opt == 0):
        _finish()
    return True


# ---- resuming ---------------------------------------------------------------------

def arm():
    """At smp.init: finds the newest complete checkpoint of the job's checkpoint
    directory, if any, and prepares the fast-forward to it."""
    _s.__init__()
    ckpt = checkpoint_dir()
    if not ckpt:
        return
    newest = os.path.join(ckpt, "newest")
    if not os.path.exists(newest):
        return
    with open(newest) as fh:
        tag = fh.read().strip()
    partial = os.path.isdir(os.path.join(ckpt, f"{tag}_partial"))
    rank = process_state.state.rank
    path = progress_path(ckpt, tag, partial, rank)
    if not os.path.exists(path):
        log.get_logger().warning(
            "smp: checkpoint '%s' (tag %s) has no progress record for rank %d (written by "
            "another world size, or by an smp without automatic resume): it is not resumed "
            "automatically; call smp.resume_from_checkpoint yourself", ckpt, tag, rank)
        return
    with open(path, "rb") as fh:
        # A file of the job's own checkpoint directory, written by smp.save_checkpoint.
        record = pickle.load(fh)
    record["dir"] = ckpt
    _s.pending = {"dir": ckpt, "tag": tag, "partial": partial}
    _s.target = record
    _s.skip_steps = record["step_calls"]
    _s.skip_opt = record["opt_steps"]
    _s.step_calls, _s.opt_steps = record["step_calls"], record["opt_steps"]
    _s.template, _s.num_mb = record["template"], record["num_mb"]
    _s.resumed_layout = record.get("bucket_layout")
    if rank == 0:
        log.get_logger().info(
            "smp: resuming from checkpoint '%s' tag %s (restart %s): the first %d step calls "
            "and %d optimizer steps are fast-forwarded", ckpt, tag,
            os.environ.get("SMP_RESTART_COUNT", "0"), _s.skip_steps, _s.skip_opt)


def take_pending():
    """At every smp.step call, before before_step(): the checkpoint to load now, as
    {"dir", "tag", "partial"} (once, at the first step call: the model and optimizer
    exist, and the script has registered its comm hook, before its first step as it
    must), else None. smp/step.py loads it with resume_from_checkpoint, then calls
    restore_hook_state(); this module stays below the checkpoint package."""
    p, _s.pending = _s.pending, None
    return p


def restore_hook_state():
    """After take_pending()'s checkpoint is loaded: the registered comm hook's state."""
    _restore_hook_state(process_state.state.model, _s.target.get("comm_hook_state"))


def _finish():
    """The fast-forward reached the checkpoint: its random states become this rank's."""
    rng = _s.target["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    np = _numpy()
    if "numpy" in rng and np is not None:
        np.random.set_state(rng["numpy"])
    _s.target = None


def before_step():
    """At every smp.step call, after take_pending(): (False, None) to compute the step,
    or (True, per-microbatch outputs) for a step the fast-forward skips (None when the
    recorded step returned nothing), which the step collects as its own."""
    if _s.target is None:
        return False, None
    if _s.skip_steps > 0:
        _s.skip_steps -= 1
        if _s.template is None:
            return True, None
        return True, [_placeholder(_s.template) for _ in range(_s.num_mb)]
    if _s.skip_opt == 0:
        _finish()  # the script's loop did not pass the save that wrote the checkpoint
    return False, None


def after_step(per_mb):
    _s.step_calls += 1
    _s.num_mb = len(per_mb)
    _s.template = _shape_of(per_mb[0]) if per_mb else None


def optimizer_step_skipped():
    """At every optimizer.step(): True when the fast-forward skips it."""
    if _s.target is not None and _s.skip_opt > 0:
        _s.skip_opt -= 1
        return True
    _s.opt_steps += 1
    return False
