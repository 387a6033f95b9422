"""Which process group a comm hook registered on an smp model reduces over.

Note [Comm hooks reduce over the dp group]
smp's reducer averages each partition's gradients over its dp group, as torch's DDP
over its own process group. A hook whose state names no group (state None, or a
state whose `process_group` is None: torch's default hooks, torch's and smp's
PowerSGDState, PostLocalSGDState) would reach for torch's world group and mix the
gradients of different partitions, so registration puts the dp group there: None
becomes `smp.get_dp_process_group()`, for built-ins, torch's hooks and user hooks
alike. A group with exactly the dp group's members is replaced by smp's dp group
object: smp keeps the dp group a group of its own even when its members equal the
world's (pp=1), so the reducer's comm thread never shares a group with the main
thread. Any other group is refused at registration, on every rank: every rank
registers, the ranks exchange their verdicts, and all raise (a rank whose own state
was fine names the failing rank).
"""
import torch.distributed as dist

from smp import agreement
from smp._C import ConfigError
from smp.groups import CommGroup, get_dp_process_group
from smp.ranks import get_dp_group

__all__ = []


def _ranks(pg):
    if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    try:
        return sorted(dist.get_process_group_ranks(pg))
    except (RuntimeError, ValueError, KeyError):
        return None  # a group torch's registry does not know (made in C++)


def _check_group(pg, what, dp_pg, dp_ranks, subset=False):
    """`pg` as the hook should use it (the dp group object), or raises ValueError."""
    if pg is dp_pg:
        return dp_pg
    ranks = _ranks(pg)
    if ranks == dp_ranks:
        return dp_pg
    if subset and ranks is not None and set(ranks) <= set(dp_ranks):
        return pg
    shown = "unknown ranks (not a group of torch.distributed, or this rank is not in it)" \
        if ranks is None else f"ranks {ranks}"
    need = "a subset of " if subset else ""
    raise ValueError(
        f"smp: register_comm_hook: {what} is a process group of {shown}, but a comm hook "
        f"on an smp model reduces over the model's dp group ({need}ranks {dp_ranks}); "
        "pass None (or smp.get_dp_process_group()) to reduce over it")


def _resolve(state, dp_pg, dp_ranks):
    if state is None:
        return dp_pg
    if isinstance(state, dist.ProcessGroup) or state is dist.GroupMember.NON_GROUP_MEMBER:
        return _check_group(state, "the hook state", dp_pg, dp_ranks)
    if hasattr(state, "process_group"):
        pg = state.process_group
        want = dp_pg if pg is None else _check_group(pg, "the state's process_group", dp_pg,
                                                    dp_ranks)
        if want is not pg:
            state.process_group = want
    sub = getattr(state, "subgroup", None)
    if isinstance(sub, dist.ProcessGroup):
        _check_group(sub, "the state's subgroup", dp_pg, dp_ranks, subset=True)
    return state


def resolve_hook_state(state):
    """The state to register on this rank's smp model (see Note [Comm hooks reduce
    over the dp group]). Collective over the world: every rank must call it.

    Raises:
        ValueError (smp.ConfigError): on every rank, if any rank's state names a group
            other than its dp group: its own message, or that of the lowest failing
            rank with "(rank R)".
    """
    dp_pg = get_dp_process_group()
    dp_ranks = sorted(get_dp_group())
    error = None
    try:
        state = _resolve(state, dp_pg, dp_ranks)
    except ValueError as e:
        error = ConfigError(str(e))
    agreement.agree(error, CommGroup.WORLD, _verdict, own_first=True)
    return state


def _verdict(failures, size):
    """A rank whose own state was fine names the lowest failing rank."""
    rank, _, text = failures[0]
    return ConfigError(f"{text} (rank {rank})")
