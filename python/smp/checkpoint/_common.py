"""What every part of smp.checkpoint shares: the error type, argument checks, where this
rank sits, and the pp group's agreement on an error."""
import os

import smp._C as _C
from smp import agreement, ranks
from smp.groups import CommGroup
from smp.model_state import PARTIAL_KEY  # noqa: F401  (merged as "any part" by _parts)
from smp.process_state import is_initialized

__all__ = []

CheckpointError = _C.CheckpointError


def check_path(name, f):
    if not isinstance(f, (str, os.PathLike)):
        raise ValueError(f"smp: {name} f={f!r} is not a path (allowed: str or os.PathLike; "
                         "SMP accepts only file names)")
    return os.fspath(f)


def check_bool(fn, name, value):
    if not isinstance(value, bool):
        raise ValueError(f"smp.{fn}: argument '{name}'={value!r} is not one of {{True, False}}")


def topology():
    """(pp rank, pp size, dp rank, dp size, world size); a world of one before smp.init."""
    if is_initialized():
        return ranks.pp_rank(), ranks.pp_size(), ranks.dp_rank(), ranks.dp_size(), ranks.size()
    return 0, 1, 0, 1, 1


def tp_layout():
    """(tp rank, tp size, rdp rank); (0, 1, dp rank) without tensor parallelism."""
    if is_initialized():
        return ranks.tp_rank(), ranks.tp_size(), ranks.rdp_rank()
    return 0, 1, 0


def part_of_rank():
    """(part index, parts, who, group) of this rank's part of a partial save: under
    tp, one part per (pp rank, tp rank) of rdp rank 0, index pp_rank * tp_size +
    tp_rank, agreed over the mp group (Note [Slices in checkpoints] in
    smp/tp_state.py); else one per pp rank, over the pp group."""
    pp_rank, pp_size, _, _, _ = topology()
    tp_rank, tp_size, _ = tp_layout()
    if tp_size == 1:
        return pp_rank, pp_size, f"pp rank {pp_rank}", CommGroup.PP_GROUP
    return (pp_rank * tp_size + tp_rank, pp_size * tp_size,
            f"pp rank {pp_rank} tp rank {tp_rank}", CommGroup.MP_GROUP)


def naming_verdict(label, where=""):
    """agreement.agree's verdict for checkpoint errors: the first failing rank's text,
    plus the ranks that hit it ("(pp ranks 0, 1<where>)") when not all of them did."""
    def verdict(failures, size):
        _, _, msg = failures[0]
        same = [r for r, _, text in failures if text == msg]
        if len(same) < size:
            msg = (f"{msg} ({label}{'s' if len(same) > 1 else ''} "
                   f"{', '.join(map(str, same))}{where})")
        return CheckpointError(msg)
    return verdict


def agree(error, what, world=False, group=None):
    """Raises on every member of the pp group (`world`: of the world) the first
    member's `error` (a str, or None). `group`: another group than the pp group.

    `what` names the agreement point for readers of this code, not for users: the
    message is the error itself, plus which ranks hit it when not all of them did
    (the same text on every rank).
    """
    verdict = naming_verdict("rank" if world or group is not None else "pp rank")
    if world and not is_initialized():
        if error is not None:
            raise CheckpointError(error)
        return
    if group is None:
        group = CommGroup.WORLD if world else CommGroup.PP_GROUP
    agreement.agree(None if error is None else CheckpointError(error), group, verdict)
