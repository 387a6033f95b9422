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


def agree(error, what, world=False):
    """Raises on every member of the pp group (`world`: of the world) the first
    member's `error` (a str, or None).

    `what` names the agreement point for readers of this code, not for users: the
    message is the error itself, plus which ranks hit it when not all of them did
    (the same text on every rank).
    """
    verdict = naming_verdict("rank" if world else "pp rank")
    if world and not is_initialized():
        if error is not None:
            raise CheckpointError(error)
        return
    agreement.agree(None if error is None else CheckpointError(error),
                    CommGroup.WORLD if world else CommGroup.PP_GROUP, verdict)
