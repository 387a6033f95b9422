"""Where this rank sits: its rank and size in the world and in each of its groups,
the members of each group, and SMP v1's rank types (smp.send(obj, 1, smp.PP_RANK))."""
import enum

from smp.groups import CommGroup, group_name
from smp.process_state import require_init, state

__all__ = []


class RankType(enum.Enum):
    """Which rank a number means: global, or inside one of the caller's groups."""

    WORLD_RANK = 0
    PP_RANK = 1
    TP_RANK = 2
    RDP_RANK = 3
    DP_RANK = 4
    MP_RANK = 5


def rank():
    require_init()
    return state.rank


def size():
    require_init()
    return state.world_size


def local_rank():
    require_init()
    return state.local_rank


def local_size():
    require_init()
    return state.local_size


def pp_rank():
    require_init()
    return state.topology.pp_rank(state.rank)


def pp_size():
    require_init()
    return state.topology.pp_size


def dp_rank():
    require_init()
    return state.topology.dp_rank(state.rank)


def dp_size():
    require_init()
    return state.topology.dp_size


def tp_rank():
    require_init()
    return state.topology.tp_rank(state.rank)


def tp_size():
    require_init()
    return state.topology.tp_size


def rdp_rank():
    require_init()
    return state.topology.rdp_rank(state.rank)


def rdp_size():
    require_init()
    return state.topology.rdp_size


def mp_rank():
    require_init()
    return state.topology.mp_rank(state.rank)


def mp_size():
    require_init()
    return state.topology.mp_size


def get_pp_group():
    require_init()
    return list(state.topology.pp_group(state.rank))


def get_dp_group():
    require_init()
    return list(state.topology.dp_group(state.rank))


def get_tp_group():
    require_init()
    return list(state.topology.tp_group(state.rank))


def get_rdp_group():
    require_init()
    return list(state.topology.rdp_group(state.rank))


def get_mp_group():
    require_init()
    return list(state.topology.mp_group(state.rank))

_RANK_GROUP = {
    RankType.WORLD_RANK: CommGroup.WORLD, RankType.PP_RANK: CommGroup.PP_GROUP,
    RankType.MP_RANK: CommGroup.MP_GROUP, RankType.DP_RANK: CommGroup.DP_GROUP,
    RankType.RDP_RANK: CommGroup.RDP_GROUP, RankType.TP_RANK: CommGroup.TP_GROUP,
}


def members(group):
    """The global ranks of this rank's `group` (a CommGroup), in group-rank order."""
    return {"world": lambda: list(range(state.world_size)), "pp": get_pp_group,
            "dp": get_dp_group, "tp": get_tp_group, "rdp": get_rdp_group,
            "mp": get_mp_group}[group_name(group)]()


def to_global(r, rank_type):
    """The global rank of rank `r` of this rank's group of `rank_type`."""
    if rank_type not in _RANK_GROUP:
        raise ValueError(f"smp: rank_type {rank_type!r} is not one of "
                         f"{{{', '.join(t.name for t in RankType)}}}")
    group = members(_RANK_GROUP[rank_type])
    if not isinstance(r, int) or not 0 <= r < len(group):
        raise ValueError(f"smp: {rank_type.name} {r!r} is outside its group of "
                         f"{len(group)} ranks {group}")
    return group[r]
