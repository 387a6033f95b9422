"""Initialisation, topology queries, process groups and object collectives.

The C++ core (``smp._C``) validates the config, checks that every rank agrees on it,
computes the rank layout and moves the bytes; this module resolves where the config
comes from, creates the ``torch.distributed`` groups (so they are registered with
torch and usable with its API) and pickles objects.
"""
import atexit
import contextlib
import datetime
import enum
import inspect
import itertools
import json
import os
import pickle
import sys
import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist

from smp import _C, launch_env, log
from smp.timeline import timeline

__all__ = []

ConfigError = _C.ConfigError


class CommGroup(enum.Enum):
    """Groups of SMP v1. With no tensor parallelism TP is each rank alone and RDP = DP."""

    WORLD = 0
    PP_GROUP = 1
    TP_GROUP = 2
    RDP_GROUP = 3
    DP_GROUP = 4
    MP_GROUP = 5


class RankType(enum.Enum):
    """Which rank a number means: global, or inside one of the caller's groups."""

    WORLD_RANK = 0
    PP_RANK = 1
    TP_RANK = 2
    RDP_RANK = 3
    DP_RANK = 4
    MP_RANK = 5


class _State:
    """Process-wide state: `smp.state` in SMP v1 (`smp.state.cfg.<key>`)."""

    def __init__(self):
        self.initialized = False
        self.cfg = None
        self.topology = None
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self.local_size = 1
        self.store = None
        self.groups = {}
        self.model = None
        self.optimizer = None
        self.microbatch = 0
        self.tracing = False
        # SMP 1.10's (smp_to_hf, hf_to_smp) state-dict translations of tensor-parallel
        # modules; none without tensor parallelism. Hugging Face's save_pretrained walks
        # it when smdistributed.modelparallel.__version__ >= 1.10.
        self.module_manager = SimpleNamespace(translate_functions=[])

    def microbatch_of_task(self):
        """The microbatch the calling thread works on (pipeline tasks), else the step's."""
        from smp.task import current
        return current.mb if current.mb is not None else self.microbatch


state = _State()


_CONFIG_ACCEPTED = ('accepted: a dict, the path of an existing JSON file holding an object '
                    'like {"partitions": 2}, or None for env SMP_CONFIG)')


def _config_text(config):
    """Resolves `config` (dict, JSON path, None) to JSON text.

    Raises:
        ConfigError: a path that does not exist, is not a file or holds no valid JSON,
            SMP_CONFIG holding a path instead of JSON, or a config of another type.
    """
    if config is None:
        raw = _C.config_from_environment()
        text = os.environ.get("SMP_CONFIG", "")
        if raw == text and not text.lstrip().startswith("{"):
            try:
                json.loads(text)
            except ValueError:
                what = "an existing file" if os.path.isfile(text) else "not JSON"
                raise ConfigError(
                    f"smp: environment SMP_CONFIG='{text}' is {what}; SMP_CONFIG holds the "
                    'JSON object itself, like {"partitions": 2} (smprun --config and '
                    "smp.init(config=path) read a file)") from None
        return raw
    if isinstance(config, dict):
        return json.dumps(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.exists(path):
            raise ConfigError(f"smp: config file '{path}' does not exist ({_CONFIG_ACCEPTED}")
        if not os.path.isfile(path):
            raise ConfigError(f"smp: config path '{path}' is not a file ({_CONFIG_ACCEPTED}")
        with open(path) as f:
            text = f.read()
        try:
            json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"smp: config file '{path}' is not valid JSON: {exc} "
                              f"({_CONFIG_ACCEPTED}") from None
        return text
    raise ConfigError(f"smp: config of type {type(config).__name__} is not supported "
                      f"({_CONFIG_ACCEPTED}")


def _env_int(name, default):
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"smp: environment {name}='{value}' is not an integer") from None


def _choose_backend(name):
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


def _wait_for_listener(addr, port, timeout_s):
    """Returns once rank 0's store accepts connections (bounded by timeout_s).

    torch's TCPStore client sleeps a whole second after a refused connection, so ranks
    that start together with rank 0 (the usual case under smprun) would each lose ~1 s
    in smp.init. A plain connect, retried every few ms, finds the listener first; the
    store then connects at once. A timeout here is left to the store's own connect,
    which reports it.
    """
    import socket
    import time
    deadline = time.monotonic() + timeout_s
    pause = 0.002
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return
        except OSError:
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


@contextlib.contextmanager
def _event_driven_group_barrier():
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


def init(config=None):
    """Initialises smp: config, process groups and rank layout.

    Args:
        config: a dict, a path to a JSON file, or None (then env ``SMP_CONFIG``, else
            ``SM_HP_MP_PARAMETERS``, else defaults).

    Raises:
        ConfigError: a bad key or value, or ranks that disagree (raised on every rank).
        SMPTimeoutError: a rank did not arrive within ``timeout_s``.
    """
    if state.initialized:
        return
    log.configure()  # SMP_LOG_LEVEL: a bad value fails here, before any rendezvous
    raw = _config_text(config)
    try:
        timeout_s = json.loads(_C.parse_config(raw))["timeout_s"]
    except (ConfigError, ValueError):
        timeout_s = 300.0  # the exchange below reports the error on every rank
    timeout = datetime.timedelta(seconds=timeout_s)

    if dist.is_initialized():
        # The script initialised torch.distributed itself: join its world and store.
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = _env_int("LOCAL_RANK", rank)
        local_size = _env_int("LOCAL_WORLD_SIZE", world)
        store = dist.distributed_c10d._get_default_store()
    else:
        where = launch_env.from_environment()
        rank, world = where.rank, where.world_size
        local_rank, local_size = where.local_rank, where.local_size
        if where.master_addr is not None:
            # Derived from SLURM or Open MPI: export them as torchrun and smprun do, so
            # torch's env:// and smp's pipeline transport see the same endpoint.
            os.environ.setdefault("MASTER_ADDR", where.master_addr)
            os.environ.setdefault("MASTER_PORT", str(where.master_port))
        store = launch_env.rendezvous(where, timeout_s, _wait_for_listener)

    cfg_json = _C.agree_config(store, rank, world, raw)
    cfg = json.loads(cfg_json)
    topo = _C.Topology(world, cfg["partitions"], cfg["placement_strategy"])
    with _event_driven_group_barrier():
        if not dist.is_initialized():
            dist.init_process_group(_choose_backend(cfg["backend"]), store=store, rank=rank,
                                    world_size=world, timeout=timeout)
        groups = _create_groups(topo, rank, world, timeout)
    _C.install(cfg_json, rank, world, local_rank, local_size, store,
               groups["world"], groups["pp"], groups["dp"])
    state.cfg = SimpleNamespace(**cfg)
    state.topology = topo
    state.rank, state.world_size = rank, world
    state.local_rank, state.local_size = local_rank, local_size
    state.store = store
    state.groups = groups
    state.initialized = True
    timeline.start(rank)
    atexit.register(timeline.close)


def _create_groups(topo, rank, world, timeout):
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
    for kind, all_groups in (("pp", topo.all_pp_groups()), ("dp", topo.all_dp_groups())):
        for ranks in all_groups:
            ranks = list(ranks)
            # Not the world group even when it has the same members: the reducer's comm
            # thread and the main thread would then issue collectives on one group.
            pg = singles[ranks[0]] if len(ranks) == 1 else dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[kind] = pg
    return groups


def shutdown():
    """Tears down smp's groups (tests and scripts that re-initialise)."""
    if not state.initialized:
        return
    if state.model is not None:
        state.model._shutdown()
    timeline.close()
    _C.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    state.__init__()


def _require_init():
    if not state.initialized:
        raise RuntimeError("smp: not initialized; call smp.init() first")


def is_initialized():
    return state.initialized


def rank():
    _require_init()
    return state.rank


def size():
    _require_init()
    return state.world_size


def local_rank():
    _require_init()
    return state.local_rank


def local_size():
    _require_init()
    return state.local_size


def pp_rank():
    _require_init()
    return state.topology.pp_rank(state.rank)


def pp_size():
    _require_init()
    return state.topology.pp_size


def dp_rank():
    _require_init()
    return state.topology.dp_rank(state.rank)


def dp_size():
    _require_init()
    return state.topology.dp_size


def tp_rank():
    _require_init()
    return 0


def tp_size():
    _require_init()
    return 1


mp_rank, mp_size = pp_rank, pp_size
rdp_rank, rdp_size = dp_rank, dp_size


def get_pp_group():
    _require_init()
    return list(state.topology.pp_group(state.rank))


def get_dp_group():
    _require_init()
    return list(state.topology.dp_group(state.rank))


def get_tp_group():
    _require_init()
    return [state.rank]


get_mp_group, get_rdp_group = get_pp_group, get_dp_group


def get_world_process_group():
    _require_init()
    return state.groups["world"]


def get_pp_process_group():
    _require_init()
    return state.groups["pp"]


def get_dp_process_group():
    _require_init()
    return state.groups["dp"]


def get_tp_process_group():
    _require_init()
    return state.groups["tp"]


get_mp_process_group, get_rdp_process_group = get_pp_process_group, get_dp_process_group

_GROUP_NAME = {
    CommGroup.WORLD: "world", CommGroup.PP_GROUP: "pp", CommGroup.MP_GROUP: "pp",
    CommGroup.DP_GROUP: "dp", CommGroup.RDP_GROUP: "dp", CommGroup.TP_GROUP: "tp",
}
_RANK_GROUP = {
    RankType.WORLD_RANK: CommGroup.WORLD, RankType.PP_RANK: CommGroup.PP_GROUP,
    RankType.MP_RANK: CommGroup.MP_GROUP, RankType.DP_RANK: CommGroup.DP_GROUP,
    RankType.RDP_RANK: CommGroup.RDP_GROUP, RankType.TP_RANK: CommGroup.TP_GROUP,
}


def _group_name(group):
    if group not in _GROUP_NAME:
        raise ValueError(f"smp: group {group!r} is not one of "
                         f"{{{', '.join(g.name for g in CommGroup)}}}")
    return _GROUP_NAME[group]


def _members(group):
    return {"world": lambda: list(range(state.world_size)), "pp": get_pp_group,
            "dp": get_dp_group, "tp": get_tp_group}[_group_name(group)]()


def _to_global(r, rank_type):
    if rank_type not in _RANK_GROUP:
        raise ValueError(f"smp: rank_type {rank_type!r} is not one of "
                         f"{{{', '.join(t.name for t in RankType)}}}")
    members = _members(_RANK_GROUP[rank_type])
    if not isinstance(r, int) or not 0 <= r < len(members):
        raise ValueError(f"smp: {rank_type.name} {r!r} is outside its group of "
                         f"{len(members)} ranks {members}")
    return members[r]


# Note [Naming the call]: every smp collective on a group first checks, through the
# store, that every member is about to make the same user-facing call (Note [Call
# agreement] in smp_core/call_agreement.h); errors name that call. The outermost
# `api_call` on the thread names it (model.state_dict() runs allgathers inside);
# without one, the collective's own name ("smp.barrier(WORLD)").
_api_call = threading.local()
# The name of a step's collectives (its first step agrees on the model and the plan):
# the same on a rank that shadows the step under join, whatever the function's name.
STEP_CALL = "an @smp.step function"


@contextlib.contextmanager
def api_call(name):
    """Names the user-facing call whose collectives run inside (the outermost wins);
    also a decorator: `@core.api_call("smp.save()")`."""
    outer = getattr(_api_call, "name", None)
    if outer is None:
        _api_call.name = name
    try:
        yield
    finally:
        if outer is None:
            _api_call.name = None


def _call_name(default):
    return getattr(_api_call, "name", None) or default


# One spelling per group in call names: MP_GROUP is PP_GROUP and RDP_GROUP is DP_GROUP
# (tp = 1), so smp.mp_barrier() on one rank agrees with smp.pp_barrier() on another.
_CALL_GROUP = {"world": "WORLD", "pp": "PP_GROUP", "dp": "DP_GROUP"}


def agree_call(group, default):
    """Before a torch collective on an smp group (e.g. dist.gather_object): every member
    of `group` is about to make the same call (see Note [Naming the call]).

    Raises:
        CommError: a member made another call, waits in a call on another group, or
            exited (named, on every waiting rank).
        SMPTimeoutError: a member did not arrive within timeout_s.
    """
    name = _group_name(group)
    if name != "tp":
        _C.agree_call(name, _call_name(default))


def _mark_exited():
    """atexit: ranks waiting for this one in an smp call raise at once, naming how it
    ended; rank 0 (the store's host under smprun) lingers briefly so they can read it."""
    try:  # also drops C++'s reference to the store (after smp.shutdown too)
        exc = getattr(sys, "last_value", None)
        how = "exited" if exc is None else f"failed ({type(exc).__name__}: {exc})"
        _C.mark_exited(how, 5.0 if state.initialized and state.rank == 0 else 0.0)
    except Exception:  # the store is gone: nobody is left to read it
        pass


atexit.register(_mark_exited)


def barrier(group=CommGroup.WORLD):
    """Blocks until every member of `group` arrives (bounded by timeout_s).

    Raises:
        CommError: a member made another smp call instead, or exited (named).
        SMPTimeoutError: a member did not arrive within timeout_s.
    """
    _require_init()
    name = _group_name(group)
    if name != "tp":
        _C.barrier(name, _call_name(f"smp.barrier({_CALL_GROUP[name]})"))


def pp_barrier():
    barrier(CommGroup.PP_GROUP)


def dp_barrier():
    barrier(CommGroup.DP_GROUP)


def mp_barrier():
    barrier(CommGroup.MP_GROUP)


def send(obj, dest_rank, rank_type=RankType.WORLD_RANK):
    """Sends a picklable object; buffered, so it returns before the receiver asks."""
    _require_init()
    _C.send_bytes(_to_global(dest_rank, rank_type), pickle.dumps(obj, protocol=4))


def recv_from(src_rank, rank_type=RankType.WORLD_RANK):
    """Receives the next object `src_rank` sent (by send or broadcast) to this rank."""
    _require_init()
    return pickle.loads(_C.recv_bytes(_to_global(src_rank, rank_type)))


def broadcast(obj, group=CommGroup.WORLD):
    """Sends `obj` to every other member of `group`; they receive with recv_from."""
    _require_init()
    data = pickle.dumps(obj, protocol=4)
    for r in _members(group):
        if r != state.rank:
            _C.send_bytes(r, data)


def allgather(obj, group=CommGroup.WORLD):
    """Returns every member's `obj`, in group-rank order."""
    _require_init()
    name = _group_name(group)
    if name == "tp":
        return [obj]
    call = _call_name(f"smp.allgather({_CALL_GROUP[name]})")
    return [pickle.loads(b) for b in _C.allgather_bytes(name, pickle.dumps(obj, protocol=4),
                                                        call)]


def gather(obj, group=CommGroup.WORLD, rank=0):
    """Returns the members' objects in group-rank order on group rank `rank`, else None."""
    with api_call(f"smp.gather({_CALL_GROUP.get(_group_name(group), 'TP_GROUP')})"):
        values = allgather(obj, group)
    me = _members(group).index(state.rank)
    return values if me == rank else None


def num_microbatches():
    _require_init()
    return state.cfg.microbatches


def is_tracing():
    return state.tracing


SMPTimeoutError = _C.SMPTimeoutError
