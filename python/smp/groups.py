"""smp's process groups: SMP v1's group names, the torch.distributed groups smp.init
creates (world, every pp group, every dp group, one-rank tp groups; with tensor
parallelism every tp, rdp and mp group too) and their getters.

Groups are made through torch.distributed (`dist.new_group`) so they are registered
there and usable with torch's API; C++ receives them with `_C.install`."""
import contextlib
import datetime
import enum
import inspect
import itertools

import torch
import torch.distributed as dist

import smp._C as _C
from smp.process_state import require_init, state

__all__ = []

ConfigError = _C.ConfigError
SMPTimeoutError = _C.SMPTimeoutError


class CommGroup(enum.Enum):
    """Groups of SMP v1 (Note [Groups under tensor parallelism], smp_core/topology.cpp).
    With no tensor parallelism TP is each rank alone, RDP = DP and MP = PP."""

    WORLD = 0
    PP_GROUP = 1
    TP_GROUP = 2
    RDP_GROUP = 3
    DP_GROUP = 4
    MP_GROUP = 5


_GROUP_NAME = {
    CommGroup.WORLD: "world", CommGroup.PP_GROUP: "pp", CommGroup.MP_GROUP: "mp",
    CommGroup.DP_GROUP: "dp", CommGroup.RDP_GROUP: "rdp", CommGroup.TP_GROUP: "tp",
}


def group_name(group):
    """The kind of `group` ("world", "pp", "dp", "tp", and with tensor parallelism
    "rdp" and "mp", which are "dp" and "pp" without it); ValueError for a non-group."""
    if group not in _GROUP_NAME:
        raise ValueError(f"smp: group {group!r} is not one of "
                         f"{{{', '.join(g.name for g in CommGroup)}}}")
    name = _GROUP_NAME[group]
    if state.topology is None or state.topology.tp_size == 1:
        name = {"mp": "pp", "rdp": "dp"}.get(name, name)
    return name


def choose_backend(name):
    """torch.distributed's backend string for config 'backend' `name`."""
    if name == "auto":
        name = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if name == "nccl":
        if not dist.is_nccl_available():
            raise ConfigError("smp: config 'backend'='nccl' is not available in this torch "
                              "build (allowed here: gloo, auto)")
        # Object collectives move CPU tensors: keep Gloo for CPU where torch allows it.
        if int(torch.__version__.split(".")[0]) >= 2:
            return "cpu:gloo,cuda:nccl"
    return name


@contextlib.contextmanager
def event_driven_group_barrier():
    """torch 1.13's init_process_group/new_group end with a store barrier that polls
    every 10 ms; smp creates ~2 + world groups, so on a busy host that polling was
    most of smp.init. Inside this context the barrier waits on a key that the last
    rank to arrive sets (TCPStore wakes waiters at once). Same semantics: every rank
    of the world checks in, bounded by the group's timeout. Only where torch's barrier
    has 1.13's signature (torch 2.x synchronises groups its own way)."""
    c10d = dist.distributed_c10d
    orig = getattr(c10d, "_store_based_barrier", None)
    if orig is None or list(inspect.signature(orig).parameters) != ["rank", "store", "timeout"]:
        yield
        return
    count = itertools.count()

    def barrier(rank, store, timeout):
        key = f"smp/group_barrier/{next(count)}"
        if store.add(key, 1) == c10d.get_world_size():
            store.set(key + "/done", b"1")
        try:
            store.wait([key + "/done"], timeout)
        except RuntimeError as exc:
            raise SMPTimeoutError(
                f"smp: timed out after {timeout} waiting for every rank to create process "
                f"group #{key.rsplit('/', 1)[1]} (smp.init, rank {rank})") from exc

    c10d._store_based_barrier = barrier
    try:
        yield
    finally:
        c10d._store_based_barrier = orig


def create_groups(topo, rank, world, timeout):
    """Every rank creates every group, in the same order (torch requires it). A
    one-rank group is created once per rank and serves as that rank's tp group and as
    its pp or dp group when that is a singleton too (it has no peer to disagree with)."""
    groups = {"world": dist.group.WORLD}
    singles = {}
    for r in range(world):
        pg = dist.new_group([r], timeout=timeout)
        singles[r] = pg
        if r == rank:
            groups["tp"] = pg
    kinds = [("pp", topo.all_pp_groups()), ("dp", topo.all_dp_groups())]
    if topo.tp_size > 1:  # Note [Groups under tensor parallelism]
        kinds += [("tp", topo.all_tp_groups()), ("rdp", topo.all_rdp_groups()),
                  ("mp", topo.all_mp_groups())]
    for kind, all_groups in kinds:
        for ranks in all_groups:
            ranks = list(ranks)
            # Not the world group even when it has the same members: the reducer's comm
            # thread and the main thread would then issue collectives on one group.
            pg = singles[ranks[0]] if len(ranks) == 1 else dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[kind] = pg
    if topo.tp_size == 1:
        groups["rdp"], groups["mp"] = groups["dp"], groups["pp"]
    return groups


def new_groups_within_pp_groups(positions, backend=None):
    """A process group of the members at pp ranks `positions` of every pp group of the
    world (every rank makes every one, in the topology's order, as torch requires);
    returns this rank's, or None when it is not at one of `positions`. Blocking waits
    are bounded by config 'timeout_s'."""
    require_init()
    timeout = datetime.timedelta(seconds=state.cfg.timeout_s)
    mine = None
    for pp in state.topology.all_pp_groups():
        ranks = [list(pp)[p] for p in positions]
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if state.rank in ranks:
            mine = group
    return mine


def get_world_process_group():
    require_init()
    return state.groups["world"]


def get_pp_process_group():
    require_init()
    return state.groups["pp"]


def get_dp_process_group():
    require_init()
    return state.groups["dp"]


def get_tp_process_group():
    require_init()
    return state.groups["tp"]


def get_rdp_process_group():
    require_init()
    return state.groups["rdp"]


def get_mp_process_group():
    require_init()
    return state.groups["mp"]


def gradient_span_group(sharded):
    """The group whose ranks together hold one replica's gradients, so a fact about
    them (the global norm's sum, the fp16 overflow flag) is combined over it: the world
    with sharded optimizer state (each rank keeps a share), the mp group (pp x tp) when
    a replica spans partitions or tp slices (the pp group when tp = 1), else None (this
    rank holds them all; dp replicas hold equal gradients after the reduction)."""
    require_init()
    if sharded:
        return state.groups["world"]
    topo = state.topology
    if topo.pp_size > 1 or topo.tp_size > 1:
        return state.groups["mp"]
    return None
