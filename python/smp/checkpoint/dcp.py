"""Interchange with torch.distributed.checkpoint (DCP), model and optimizer state both.

    python -m smp.checkpoint to-dcp CKPT_DIR DCP_DIR [--tag T]    # smp -> DCP
    python -m smp.checkpoint from-dcp DCP_DIR CKPT_DIR [--tag T]  # DCP -> smp

A DCP checkpoint here is what torch's own usual code writes for a plain (unwrapped)
module, `dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model,
opt)})`: the model's state dict with its plain keys, and the optimizer's state keyed by
parameter name (FQN), `{"state": {fqn: {...}}, "param_groups": [{..., "params":
[fqns]}]}`. smp's by-name optimizer form (`opt.local_state_dict()`, merged) is the same
thing plus the `_smp_by_name` marker, so the optimizer state translates entry for entry.

- `to_dcp(src, dst, tag=None)`: `src` is a save_checkpoint directory; `tag` (default:
  the one `src/newest` names, or the only checkpoint in `src`) picks the checkpoint,
  partial (`{tag}_partial/`) or full (`{tag}`, `{tag}.optimizer`). Every smp file is
  verified as it is read (merge_partial, smp.load). `dst` is written by DCP's
  FileSystemWriter in this one process (no process group).
- `from_dcp(src, dst, tag=None)`: the whole DCP checkpoint `src` is read into plain
  dicts without knowing the module (DCP's `_EmptyStateDictLoadPlanner`, as
  `format_utils.dcp_to_torch_save`) and written as smp's full save_checkpoint layout
  with smp.save(partial=False): `dst/{tag}` (model), `dst/{tag}.optimizer` (by name),
  `dst/user_content_{tag}`, then `dst/newest`. `smp.resume_from_checkpoint(dst,
  partial=False)` loads it in a job of any partitioning.

What does not translate is listed in docs/checkpoint.md ("Interchange with
torch.distributed.checkpoint (DCP)").

Note [DCP imported when used]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch.distributed.checkpoint is imported inside the functions that use it, not here:
smp.checkpoint exports to_dcp/from_dcp lazily and `python -m smp.checkpoint merge`
imports this module for its parser, and neither should pay for DCP's import (it pulls
in torch.distributed's tensor and FSDP packages) unless a conversion runs.
"""
import os
import re
import sys
import tempfile
import warnings

import torch

from smp.checkpoint._api import load, save
from smp.checkpoint._common import CheckpointError
from smp.checkpoint.merge import merge_partial
from smp.model_state import PARTIAL_KEY, SHARDS_KEY
from smp.optimizer import _BY_NAME

__all__ = ["to_dcp", "from_dcp"]

_NEWEST = "newest"  # save_checkpoint's file naming the newest tag (_resume.py)
_PARTIAL = re.compile(r"^(model|optimizer|user_content)_(\d+)(\.prev)?$")
_SHARD = re.compile(r"^optimizer_(\d+)_(\d+)$")
_SMP_MARKERS = (PARTIAL_KEY, SHARDS_KEY, _BY_NAME)  # smp's own flags, not state


def _err(cmd, msg):
    return CheckpointError(f"smp: {cmd}: {msg}")


def _check_keys(cmd, model_key, optim_key):
    if not isinstance(model_key, str) or not model_key:
        raise ValueError(f"smp: {cmd}: model_key={model_key!r} is not a non-empty string")
    if optim_key is not None and (not isinstance(optim_key, str) or not optim_key):
        raise ValueError(f"smp: {cmd}: optim_key={optim_key!r} is not None or a non-empty string")
    if optim_key == model_key:
        raise ValueError(f"smp: {cmd}: model_key and optim_key are both {model_key!r}")


def _check_tag(cmd, tag):
    if not isinstance(tag, str) or not tag or "/" in tag or tag == _NEWEST:
        raise ValueError(f"smp: {cmd}: tag={tag!r} is not a non-empty name without '/' "
                         f"(and not '{_NEWEST}')")
    return tag


# ---- smp -> DCP --------------------------------------------------------------------

def _tags_in(src):
    """{tag: kind} of the checkpoints save_checkpoint wrote in `src` ("partial" wins)."""
    found = {}
    for name in sorted(os.listdir(src)):
        full = os.path.join(src, name)
        if name.endswith(".optimizer") and os.path.isfile(full):
            found.setdefault(name[:-len(".optimizer")], "full")
        elif name.startswith("user_content_") and os.path.isfile(full):
            found.setdefault(name[len("user_content_"):], "full")
    for name in sorted(os.listdir(src)):
        if name.endswith("_partial") and os.path.isdir(os.path.join(src, name)):
            found[name[:-len("_partial")]] = "partial"
    return found


def _resolve(src, tag, partial):
    """(tag, partial) of the checkpoint to convert in save_checkpoint directory `src`."""
    if not os.path.isdir(src):
        raise _err("to-dcp", f"checkpoint directory '{src}' does not exist")
    if tag is None:
        newest = os.path.join(src, _NEWEST)
        if os.path.isfile(newest):
            with open(newest) as fh:
                tag = fh.read().strip()
        else:
            tags = _tags_in(src)
            if len(tags) != 1:
                raise _err("to-dcp", f"'{src}' has no '{_NEWEST}' file and "
                           + (f"holds several checkpoints {sorted(tags)}: give the tag (--tag)"
                              if tags else "no save_checkpoint checkpoint (a '{tag}_partial' "
                              "directory or '{tag}' with 'user_content_{tag}')"))
            tag = next(iter(tags))
    _check_tag("to-dcp", tag)
    has_partial = os.path.isdir(os.path.join(src, f"{tag}_partial"))
    has_full = os.path.isfile(os.path.join(src, tag))
    if partial is None:
        partial = has_partial or not has_full
    if partial and not has_partial:
        raise _err("to-dcp", f"partial checkpoint directory '{os.path.join(src, tag)}_partial' "
                   "does not exist")
    if not partial and not has_full:
        raise _err("to-dcp", f"full checkpoint '{os.path.join(src, tag)}' (the model state "
                   "dict of save_checkpoint(partial=False)) does not exist")
    return tag, partial


def _strip_markers(sd):
    return {k: v for k, v in sd.items() if k not in _SMP_MARKERS}


def _read_shards(files):
    """A sharded optimizer's shares (`optimizer_{pp}_{dp}`, each a full smp file): the
    state by name of every share, param groups merged by index (each share lists only
    its own parameters)."""
    state, groups, rest, by_name = {}, [], {}, True
    for f in files:
        share = load(f, partial=False, map_location="cpu")
        by_name = by_name and bool(share.get(_BY_NAME))
        state.update(share.get("state", {}))
        for i, g in enumerate(share.get("param_groups", [])):
            if i == len(groups):
                groups.append(dict(g, params=[]))
            groups[i]["params"].extend(n for n in g["params"] if n not in groups[i]["params"])
        for k, v in share.items():
            if k not in ("state", "param_groups"):
                rest.setdefault(k, v)
    return dict(_strip_markers(rest), state=state, param_groups=groups, **{_BY_NAME: by_name})


def _read_partial(src, tag):
    d = os.path.join(src, f"{tag}_partial")
    names = os.listdir(d)
    kinds = {m.group(1) for m in map(_PARTIAL.match, names) if m}
    if "model" not in kinds:
        raise _err("to-dcp", f"'{d}' holds no model parts ('model_<pp_rank>')")
    model = merge_partial(os.path.join(d, "model"), map_location="cpu")
    optim = None
    if "optimizer" in kinds:
        optim = merge_partial(os.path.join(d, "optimizer"), map_location="cpu")
    else:
        shards = sorted((int(m.group(1)), int(m.group(2)), n)
                        for m, n in ((_SHARD.match(n), n) for n in names) if m)
        if shards:
            optim = _read_shards([os.path.join(d, n) for _, _, n in shards])
    content = None
    if "user_content" in kinds:
        content = merge_partial(os.path.join(d, "user_content"), map_location="cpu")
    return model, optim, content


def _read_full(src, tag):
    model = load(os.path.join(src, tag), partial=False, map_location="cpu")
    opt_path = os.path.join(src, f"{tag}.optimizer")
    optim = load(opt_path, partial=False, map_location="cpu") if os.path.exists(opt_path) else None
    uc = os.path.join(src, f"user_content_{tag}")
    content = load(uc, partial=False, map_location="cpu") if os.path.exists(uc) else None
    return model, optim, content


def _param_names(model_sd, n, module):
    """The names of the `n` parameters a full save's positional optimizer state numbers:
    `module.named_parameters()`, or the model state dict's floating-point entries
    (tied entries once), which must then be exactly `n`."""
    if module is not None:
        return [name for name, _ in module.named_parameters()]
    names, seen = [], set()
    for k, v in model_sd.items():
        if not torch.is_tensor(v) or not (v.is_floating_point() or v.is_complex()):
            continue
        ident = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape),
                 v.stride(), v.dtype)
        if v.numel() and ident in seen:
            continue  # a tied parameter under a second name
        seen.add(ident)
        names.append(k)
    if len(names) != n:
        raise _err("to-dcp", f"the full save's optimizer state is numbered by position over "
                   f"{n} parameters, but its model state dict has {len(names)} floating-point "
                   "entries (buffers?), so the parameter names cannot be told: convert a "
                   "partial save (save_checkpoint(partial=True), whose optimizer state is "
                   "keyed by name), or call smp.checkpoint.to_dcp(..., module=plain_module)")
    return names


def _positional_to_names(osd, model_sd, module):
    """A full save's torch-positional optimizer state -> by name. Positions follow the
    module's parameter order within each group, groups in order (as smp numbers them
    for `torch.optim.X(model.parameters())`); every per-parameter state tensor must
    have its parameter's shape, else the order was another one."""
    groups = osd["param_groups"]
    n = sum(len(g["params"]) for g in groups)
    names = _param_names(model_sd, n, module)
    if len(names) < n:
        raise _err("to-dcp", f"the optimizer state numbers {n} parameters, the module has "
                   f"{len(names)}")
    shapes = {}
    if module is not None:
        shapes = {k: tuple(p.shape) for k, p in module.named_parameters()}
    shapes.update({k: tuple(v.shape) for k, v in model_sd.items() if torch.is_tensor(v)})
    by_pos, out_groups, off = {}, [], 0
    for g in groups:
        ids = sorted(g["params"])
        mine = names[off:off + len(ids)]
        off += len(ids)
        by_pos.update(zip(ids, mine))
        out_groups.append(dict(g, params=mine))
    state = {}
    for i, s in osd["state"].items():
        name = by_pos.get(i)
        if name is None:
            raise _err("to-dcp", f"optimizer state for position {i}, which no parameter group "
                       "lists")
        for k, v in (s.items() if isinstance(s, dict) else ()):
            if torch.is_tensor(v) and v.dim() > 0 and name in shapes \
                    and tuple(v.shape) != shapes[name]:
                raise _err("to-dcp", f"the full save's optimizer state at position {i} ('{k}', "
                           f"shape {tuple(v.shape)}) does not fit parameter '{name}' (shape "
                           f"{shapes[name]}): its optimizer did not number the parameters in "
                           "the module's order; convert a partial save "
                           "(save_checkpoint(partial=True), keyed by name) instead")
        state[name] = s
    rest = {k: v for k, v in osd.items() if k not in ("state", "param_groups")}
    return dict(_strip_markers(rest), state=state, param_groups=out_groups)


def _optim_for_dcp(osd, model_sd, module):
    """smp's optimizer state (by name, or a full save's positions) in
    get_optimizer_state_dict's form: each group's parameters in the module's order."""
    if not isinstance(osd, dict) or "param_groups" not in osd or "state" not in osd:
        raise _err("to-dcp", "the optimizer file holds no optimizer state dict (no "
                   "'state'/'param_groups')")
    if osd.get(_BY_NAME):
        osd = _strip_markers(osd)
    else:
        osd = _positional_to_names(osd, model_sd, module)
    order = {k: i for i, k in enumerate(model_sd)}
    missing = [n for g in osd["param_groups"] for n in g["params"] if n not in order]
    if missing:
        raise _err("to-dcp", f"optimizer parameters {missing[:5]} are not keys of the model "
                   "state dict")
    groups = [dict(g, params=sorted(g["params"], key=order.__getitem__))
              for g in osd["param_groups"]]
    return dict(osd, param_groups=groups)


def _dcp_failure(cmd, what, e):
    """A CheckpointError (one line) for an exception DCP raised; DCP's own
    CheckpointException (a BaseException) wraps each rank's: the first one is named."""
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        raise e
    cause = e
    failures = getattr(e, "failures", None)  # {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) and first else first
        cause = first if isinstance(first, BaseException) else e
    text = " ".join(str(cause).split()) or "(no message: a truncated or damaged file?)"
    return _err(cmd, f"{what} failed: {type(cause).__name__}: {text[:500]}")


def _dcp_write(state_dict, dst):
    import torch.distributed.checkpoint as dcp  # Note [DCP imported when used]
    try:
        with warnings.catch_warnings():
            # "torch.distributed is disabled ...: assuming ... a single process": so it is.
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(dst), no_dist=True)
    except BaseException as e:  # noqa: BLE001  (as in _dcp_read)
        raise _dcp_failure("to-dcp", f"writing DCP checkpoint '{dst}'", e) from e


def to_dcp(src, dst, tag=None, *, partial=None, model_key="model", optim_key="optim",
           user_content_key="user_content", module=None):
    """Converts a save_checkpoint checkpoint into a DCP checkpoint directory.

    Args:
        src: the directory given to smp.save_checkpoint.
        dst: the DCP checkpoint directory to write (created; DCP's FileSystemWriter
            overwrites a checkpoint there).
        tag: the checkpoint's tag; default: the one `src/newest` names, or the only
            checkpoint in `src`.
        partial: True/False: the partial (`{tag}_partial/`) or full (`{tag}`) save of
            that tag; None: the partial one if it exists.
        model_key, optim_key: the DCP's top-level keys of the model and optimizer state.
        user_content_key: the key of save_checkpoint's user content (written when not
            None); None: leave it out.
        module: for a full save only, the plain module whose `named_parameters()` name
            the positions of its optimizer state; by default they are the model state
            dict's floating-point entries, in order, when their count fits.

    Returns:
        {"tag", "partial", "keys": the DCP's top-level keys}.

    Raises:
        CheckpointError: no such checkpoint, a damaged smp file, or an optimizer state
            whose parameter names cannot be told (named in the message).
        ValueError: a bad argument.
    """
    _check_keys("to-dcp", model_key, optim_key)
    src, dst = os.fspath(src), os.fspath(dst)
    tag, partial = _resolve(src, tag, partial)
    model, optim, content = (_read_partial if partial else _read_full)(src, tag)
    if not isinstance(model, dict):
        raise _err("to-dcp", f"the model file of checkpoint '{tag}' in '{src}' holds "
                   f"{type(model).__name__}, not a state dict")
    model = _strip_markers(model)
    out = {model_key: model}
    if optim is not None and optim_key is not None:
        out[optim_key] = _optim_for_dcp(optim, model, module)
    if isinstance(content, dict) and "user_content" in content:
        content = content["user_content"]  # save_checkpoint's {"user_content", "tag"}
    if content is not None and user_content_key is not None:
        if user_content_key in out:
            raise ValueError(f"smp: to-dcp: user_content_key {user_content_key!r} is also the "
                             "model's or the optimizer's key")
        out[user_content_key] = content
    _dcp_write(out, dst)
    return {"tag": tag, "partial": partial, "keys": list(out)}


# ---- DCP -> smp --------------------------------------------------------------------

def _dcp_read(src):
    """The whole DCP checkpoint `src` as plain nested dicts, in this process."""
    # Note [DCP imported when used]
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    if not os.path.isdir(src):
        raise _err("from-dcp", f"DCP checkpoint directory '{src}' does not exist")
    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise _err("from-dcp", f"'{src}' is not a DCP checkpoint (no '.metadata' file)")
    sd = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            # what format_utils.dcp_to_torch_save runs, without the file it writes
            # (Note [DCP imported when used])
            try:
                from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
            except ImportError:
                _load_state_dict = None
            if _load_state_dict is not None:
                _load_state_dict(sd, storage_reader=FileSystemReader(src),
                                 planner=_EmptyStateDictLoadPlanner(), no_dist=True)
            else:  # Note [DCP imported when used]
                from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
                with tempfile.TemporaryDirectory() as tmp:
                    dcp_to_torch_save(src, os.path.join(tmp, "sd.pt"))
                    sd = torch.load(os.path.join(tmp, "sd.pt"), weights_only=False)
    except BaseException as e:  # noqa: BLE001  (DCP's CheckpointException is a BaseException)
        raise _dcp_failure("from-dcp", f"reading DCP checkpoint '{src}'", e) from e
    return sd


def _optim_from_dcp(osd, key, model):
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict) \
            or not isinstance(osd.get("param_groups"), list):
        raise _err("from-dcp", f"entry '{key}' is not an optimizer state dict by parameter "
                   "name (get_optimizer_state_dict's {'state': {fqn: ...}, 'param_groups': "
                   "[...]})")
    names = [n for g in osd["param_groups"] for n in g.get("params", [])]
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise _err("from-dcp", f"entry '{key}' numbers parameters by position ({bad[:5]}), not "
                   "by name: save get_optimizer_state_dict(model, opt), not opt.state_dict()")
    unknown = [n for n in names + list(osd["state"]) if n not in model]
    if unknown:
        raise _err("from-dcp", f"optimizer parameters {sorted(set(unknown))[:5]} are not keys "
                   "of the model state dict (were both taken from the same plain module?)")
    return dict(osd, **{_BY_NAME: True})


def _write_newest(dst, tag):
    """`dst/newest` = tag, atomically (as save_checkpoint: written last)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{_NEWEST}.tmp-", dir=dst)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(tag.encode())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(dst, _NEWEST))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dfd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def from_dcp(src, dst, tag=None, *, model_key="model", optim_key="optim",
             user_content_key="user_content"):
    """Converts a DCP checkpoint of a plain module into smp's full save_checkpoint layout.

    Args:
        src: the DCP checkpoint directory (written by any number of ranks).
        dst: the save_checkpoint directory to write into (created if missing).
        tag: the tag of the new checkpoint; default: `src`'s base name.
        model_key: the DCP's top-level key of the model state dict.
        optim_key: the key of the optimizer state (get_optimizer_state_dict's form);
            None: the model only.
        user_content_key: the other top-level entries become the user content that
            resume_from_checkpoint returns: a dict of them, or, when the only one is
            `user_content_key` (what to_dcp writes), its value.

    Returns:
        The tag written (`dst/newest` names it).

    Raises:
        CheckpointError: not a DCP checkpoint, a key missing (naming the keys found), or
            an optimizer state not keyed by the model's parameter names.
        ValueError: a bad argument.
    """
    _check_keys("from-dcp", model_key, optim_key)
    src, dst = os.fspath(src), os.fspath(dst)
    tag = _check_tag("from-dcp", tag if tag is not None
                     else os.path.basename(os.path.normpath(os.path.abspath(src))))
    sd = _dcp_read(src)
    for key in (model_key, optim_key):
        if key is not None and key not in sd:
            raise _err("from-dcp", f"key '{key}' is not in DCP checkpoint '{src}' (keys: "
                       f"{sorted(map(str, sd))})")
    model = sd[model_key]
    if not isinstance(model, dict):
        raise _err("from-dcp", f"entry '{model_key}' holds {type(model).__name__}, not a "
                   "state dict")
    optim = _optim_from_dcp(sd[optim_key], optim_key, model) if optim_key is not None else None
    extra = {k: v for k, v in sd.items() if k not in (model_key, optim_key)}
    content = (extra[user_content_key] if list(extra) == [user_content_key]
               else extra or None)
    os.makedirs(dst, exist_ok=True)
    save(model, os.path.join(dst, tag), partial=False)
    if optim is not None:
        save(optim, os.path.join(dst, f"{tag}.optimizer"), partial=False)
    save({"user_content": content, "tag": tag}, os.path.join(dst, f"user_content_{tag}"),
         partial=False)
    _write_newest(dst, tag)
    return tag


# ---- the CLI (python -m smp.checkpoint to-dcp / from-dcp) ---------------------------

def add_commands(sub):
    """Adds `to-dcp` and `from-dcp` to `python -m smp.checkpoint`'s subcommands (argparse
    subparsers; __main__.py passes this to merge.main)."""
    t = sub.add_parser(
        "to-dcp", help="convert a save_checkpoint checkpoint into a DCP checkpoint",
        description="Converts the save_checkpoint checkpoint in SRC (tag: --tag, else the "
                    "one SRC/newest names, else the only one) into a torch.distributed."
                    "checkpoint directory DST holding {MODEL_KEY: the plain module's state "
                    "dict, OPTIM_KEY: the optimizer state as get_optimizer_state_dict gives it}.")
    t.add_argument("src", metavar="SRC", help="the directory given to smp.save_checkpoint")
    t.add_argument("dst", metavar="DST", help="the DCP checkpoint directory to write")
    t.add_argument("--tag", help="the checkpoint's tag (default: SRC/newest)")
    kind = t.add_mutually_exclusive_group()
    kind.add_argument("--partial", dest="partial", action="store_true", default=None,
                      help="the partial save of the tag (default: partial if it exists)")
    kind.add_argument("--full", dest="partial", action="store_false",
                      help="the full save (partial=False) of the tag")
    f = sub.add_parser(
        "from-dcp", help="convert a DCP checkpoint into a full save_checkpoint checkpoint",
        description="Converts the DCP checkpoint SRC of a plain module ({MODEL_KEY: "
                    "model.state_dict(), OPTIM_KEY: get_optimizer_state_dict(model, opt)}) "
                    "into smp's full save_checkpoint layout in DST (DST/TAG, "
                    "DST/TAG.optimizer, DST/user_content_TAG, DST/newest): "
                    "smp.resume_from_checkpoint(DST, partial=False) loads it.")
    f.add_argument("src", metavar="SRC", help="the DCP checkpoint directory")
    f.add_argument("dst", metavar="DST", help="the save_checkpoint directory to write into")
    f.add_argument("--tag", help="the new checkpoint's tag (default: SRC's base name)")
    for p in (t, f):
        p.add_argument("--model-key", default="model",
                       help="the DCP's key of the model state (default: model)")
        p.add_argument("--optim-key", default="optim",
                       help="the DCP's key of the optimizer state (default: optim; '' for none)")
        p.set_defaults(run=_run)


def _run(args):
    """Runs a parsed to-dcp / from-dcp command; errors print one line, status 1."""
    optim_key = args.optim_key or None
    try:
        if args.command == "to-dcp":
            to_dcp(args.src, args.dst, args.tag, partial=args.partial,
                   model_key=args.model_key, optim_key=optim_key)
        else:
            from_dcp(args.src, args.dst, args.tag, model_key=args.model_key,
                     optim_key=optim_key)
    except (CheckpointError, ValueError, OSError) as e:
        text = " ".join(str(e).split())
        print(text if text.startswith("smp") else f"smp: {args.command}: {text}",
              file=sys.stderr)
        return 1
    return 0

