"""Merging the parts of a partial save into one plain state dict, outside any job.

A partial save (`smp.save(obj, f, partial=True)`, `smp.save_checkpoint(partial=True)`)
is one file per pp rank, `f_0 .. f_{n-1}`, each holding that rank's entries. Each part
loads with `torch.load`, but a plain module needs all of them:

    python -m smp.checkpoint merge ck.pt_0 ck.pt_1 model.pt
    module.load_state_dict(torch.load("model.pt"))

C++ (`checkpoint/parts.h`) checks that the files are the parts of one save (same save
id, every part index once, none missing, no full file among them) and verifies every
byte of every part against its manifest before anything is unpickled; this module
unpickles the parts and merges them by key (the same merge smp.load uses):

- a model state dict (`model.local_state_dict()`) becomes the plain module's state
  dict (smp's `_smp_is_partial` marker removed);
- an optimizer state dict (`opt.local_state_dict()`) stays in smp's by-name form,
  `{"state": {param name: state}, "param_groups": [{..., "params": [names]}],
  "_smp_by_name": True}`: smp's `DistributedOptimizer.load_state_dict` reads it in a
  job of any partitioning, and `optimizer_to_torch(sd, module)` turns it into torch's
  positional format for a plain optimizer over `module.parameters()`;
- a dict of several things (`{"model": ..., "opt": ..., "step": 7}`) merges entry by
  entry; `--key model` writes only that entry. Values that are not dicts (the step)
  come from part 0.
- under tensor parallelism a save has a part per (pp rank, tp rank) (`f_{pp * tp_size +
  tp}`): the tp ranks' slices of a tensor (and of its optimizer state, exp_avg ...)
  are concatenated into the full tensor, so the merged model state dict loads into the
  plain (reference) module (Note [Slices in checkpoints] in smp/tp_state.py).
"""
import argparse
import collections
import os
import pickle
import sys

import torch

import smp._C as _C
from smp import tp_state
from smp.checkpoint import _parts, _read
from smp.checkpoint._common import PARTIAL_KEY, CheckpointError
from smp.optimizer import _BY_NAME

__all__ = []


def _strip_partial(obj, name=""):
    """`obj` without smp's `_smp_is_partial` and `_smp_tp` markers, in any dict it
    holds, and with the tp slices of each tensor concatenated into the full tensor
    (Note [Slices in checkpoints] in smp/tp_state.py)."""
    if isinstance(obj, tp_state.Slices):
        return obj.full(name)
    if isinstance(obj, dict):
        out = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
        for k, v in obj.items():
            if k not in (PARTIAL_KEY, tp_state.TP_KEY):
                out[k] = _strip_partial(v, k if isinstance(k, str) else name)
        return out
    return obj


def merge_partial(paths, map_location=None):
    """Merges the parts of one partial save into one object (see the module docstring).

    Args:
        paths: the part files in any order (`ck.pt_0`, `ck.pt_1`, or `ck.pt_1.prev`), or
            one name given to smp.save (`ck.pt`): then the newest complete save found
            under it, as smp.load reads it.
        map_location: as torch.load.

    Returns:
        The merged object: for parts of `model.local_state_dict()` the plain module's
        state dict.

    Raises:
        CheckpointError: a missing, truncated or altered part (checksums), a full file
            among the parts, parts of different saves or checkpoints, a part given twice
            or missing, or several parts that do not hold dicts; the message names the
            files.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if len(paths) == 1 and not os.path.exists(paths[0]):
        paths, _ = _C.checkpoint_resolve_partial(paths[0])  # a name given to smp.save
    parts = _C.checkpoint_read_parts(paths)  # ordered, every byte verified
    objs = [_read.unpickle(records, map_location, pickle, {}) for _, records in parts]
    kinds = sorted({type(o).__name__ for o in objs if not isinstance(o, dict)})
    if kinds and len(objs) > 1:
        raise CheckpointError(f"smp: merge: the parts {paths} hold {', '.join(kinds)}, not "
                              "dicts: there is nothing to merge by key (torch.load each part)")
    return _strip_partial(_parts.merge(objs))


def optimizer_to_torch(state_dict, module):
    """smp's by-name optimizer state (a merged `opt.local_state_dict()`) -> torch's
    positional `Optimizer.state_dict()` format, for a plain optimizer built over the
    plain `module`'s parameters: positions follow `module.named_parameters()` within
    each parameter group, groups in their saved order (as `torch.optim.Adam(
    module.parameters())` or groups listed in the module's order number them).

    Args:
        state_dict: a by-name optimizer state dict (key `_smp_by_name`).
        module: the plain module the optimizer is built on.

    Returns:
        {"state": {index: state}, "param_groups": [{..., "params": [indexes]}]}.

    Raises:
        ValueError: not a by-name optimizer state dict, or a parameter name the module
            does not have (named).
    """
    if not isinstance(state_dict, dict) or not state_dict.get(_BY_NAME) \
            or "param_groups" not in state_dict:
        raise ValueError("smp.checkpoint.optimizer_to_torch: not smp's by-name optimizer state "
                         "(expected the merge of opt.local_state_dict(), with key "
                         f"'{_BY_NAME}')")
    order = {name: i for i, (name, _) in enumerate(module.named_parameters())}
    unknown = [n for g in state_dict["param_groups"] for n in g["params"] if n not in order]
    if unknown:
        raise ValueError(f"smp.checkpoint.optimizer_to_torch: parameters {unknown[:5]} are not "
                         f"among the module's {len(order)} named parameters")
    state, groups, index = {}, [], 0
    for g in state_dict["param_groups"]:
        names = sorted(g["params"], key=order.__getitem__)
        ids = list(range(index, index + len(names)))
        index += len(names)
        for i, n in zip(ids, names):
            if n in state_dict["state"]:
                state[i] = state_dict["state"][n]
        groups.append(dict(g, params=ids))
    return {"state": state, "param_groups": groups}


def main(argv, commands=()):
    """`python -m smp.checkpoint merge [--key KEY] PART... OUT`; returns the exit status.
    `commands`: functions that add further subcommands to the parser's subparsers, each
    with a `run(args)` default that runs it (dcp.add_commands: `to-dcp`, `from-dcp`)."""
    parser = argparse.ArgumentParser(
        prog="python -m smp.checkpoint",
        description="Tools for smp checkpoints (docs/checkpoint.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser(
        "merge", help="merge the parts of a partial save into one plain torch.save file",
        description="Merges the parts f_0 .. f_{n-1} of one partial smp.save into one plain "
                    "torch.save file: a model's parts give the plain module's state dict "
                    "(module.load_state_dict(torch.load(OUT))). Every part is verified first.")
    m.add_argument("parts", nargs="+", metavar="PART",
                   help="the part files (any order), or the name given to smp.save")
    m.add_argument("out", metavar="OUT", help="the file to write (plain torch.save)")
    m.add_argument("--key", help="write only this entry of the merged dict (e.g. model)")
    for add in commands:
        add(sub)
    args = parser.parse_args(argv)
    if args.command != "merge":
        return args.run(args)
    out = os.path.abspath(args.out)
    if any(os.path.abspath(p) == out for p in args.parts):
        print(f"smp: merge: OUT '{args.out}' is one of the parts", file=sys.stderr)
        return 2
    try:
        merged = merge_partial(args.parts, map_location="cpu")
    except CheckpointError as e:
        print(e, file=sys.stderr)
        return 1
    if args.key is not None:
        if not isinstance(merged, dict) or args.key not in merged:
            keys = sorted(map(str, merged)) if isinstance(merged, dict) else []
            print(f"smp: merge: --key '{args.key}' is not in the merged dict (keys: {keys})",
                  file=sys.stderr)
            return 2
        merged = merged[args.key]
    d = os.path.dirname(out)
    if not os.path.isdir(d):
        print(f"smp: merge: directory '{d}' of OUT does not exist: create it first",
              file=sys.stderr)
        return 2
    tmp = os.path.join(d, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    try:
        torch.save(merged, tmp)
        os.replace(tmp, out)  # never a half-written OUT
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return 0
