"""Where this process sits in the job: rank, world size, local rank and size, and the
store it meets its peers on, read from whichever launcher started it.

Sources, first match wins (docs/launcher.md, "Launching without smprun"):

1. ``RANK`` set: smprun, torchrun, or a user's own exports (``WORLD_SIZE``,
   ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), parsed by
   C++ (``smp._C.process_env``: ``ProcessEnv`` in smp_core/runtime.h, the parser
   smp::init uses). Under
   torchrun (``TORCHELASTIC_RUN_ID`` set) the store comes from torch's own ``env://``
   rendezvous handler, which connects to the agent's store as a client when
   ``TORCHELASTIC_USE_AGENT_STORE=True``; smp's keys carry the restart attempt.
2. ``OMPI_COMM_WORLD_RANK`` set: a script started directly by Open MPI's ``mpirun``.
3. ``SLURM_PROCID`` set: a script started directly by ``srun``.

(2 and 3 are parsed here, in Python, with C++'s integer parser and SLURM rules: they
derive a world that C++'s smp::init does not read, which refuses such a process.)
4. None of them: a world of 1.

Note [Open MPI before SLURM]: ``mpirun`` inside a SLURM allocation starts processes
that inherit the batch step's ``SLURM_PROCID=0`` and ``SLURM_NTASKS``; the
``OMPI_COMM_WORLD_*`` variables are the ones mpirun set for this very process, so they
win. ``srun`` never sets ``OMPI_COMM_WORLD_*``.

The SLURM rules for the rank 0 host and the tasks per node are smprun's, by its own
parser bound into smp._C (``first_slurm_host``, ``slurm_tasks_on_node`` in
launcher/scheduler_env.cpp): the first host of the nodelist, or 127.0.0.1 on one node,
and ``MASTER_PORT`` defaults to smprun's several-node default, 29500.
"""
import itertools
import os
from datetime import timedelta

import torch.distributed as dist

import smp._C as _C

__all__ = []

ConfigError = _C.ConfigError

# smprun's default --master_port on several nodes (docs/launcher.md); srun and mpirun
# start every rank at once, so no rank can pick a free port for the others. One value
# for both: smp_common/env.h's kDefaultMasterPort, which smprun compiles in.
_DEFAULT_MASTER_PORT = _C.DEFAULT_MASTER_PORT


class WorldEnv:
    """This process's place in the job, resolved from its environment.

    Attributes:
        source: "single", "env", "torchelastic", "openmpi" or "slurm".
        rank, world_size, local_rank, local_size: ints.
        master_addr, master_port: rank 0's store endpoint (None for a world of 1 and
            under torchrun, where torch's handler reads them itself).
        key_prefix: prefix of every store key of this job ("" when the store is the
            job's own), so jobs that meet on one default port never read each other's.
    """

    def __init__(self, source, rank, world_size, local_rank, local_size,
                 master_addr=None, master_port=None, key_prefix=""):
        self.source = source
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_size = local_rank, local_size
        self.master_addr, self.master_port = master_addr, master_port
        self.key_prefix = key_prefix
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"smp: rank {rank} is not in [0, world size {world_size}) "
                              f"({_source_vars(source)})")

    def __repr__(self):
        return (f"WorldEnv({self.source}: rank {self.rank} of {self.world_size}, local "
                f"{self.local_rank} of {self.local_size}, store {self.master_addr}:"
                f"{self.master_port})")


def _source_vars(source):
    return {"env": "RANK, WORLD_SIZE", "torchelastic": "RANK, WORLD_SIZE (torchrun)",
            "openmpi": "OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE (mpirun)",
            "slurm": "SLURM_PROCID, SLURM_NTASKS (srun)"}.get(source, source)


# What ProcessEnv reads (smp_core/runtime.h).
_PROCESS_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _int(env, name, why, default=None):
    """The integer in env[name]; `default` when unset, else ConfigError naming the
    variable and `why` it is needed (default None), or a malformed value (C++'s
    integer parser, the one ProcessEnv uses)."""
    value = env.get(name)
    if value in (None, ""):
        if default is not None:
            return default
        raise ConfigError(f"smp: environment {name} is not set, {why}")
    return _C.env_int(name, 0, {name: value})


def _master_port(env):
    return _int(env, "MASTER_PORT", "", default=_DEFAULT_MASTER_PORT)


def from_environment(env=None):
    """Resolves this process's WorldEnv from `env` (default: os.environ).

    Raises:
        ConfigError: a launcher's variables are incomplete or malformed (the message
            names the variable), or several nodes and no way to find rank 0's host.
    """
    env = os.environ if env is None else env
    if "RANK" in env:
        # smprun's and torchrun's variables: C++'s one parser of them (ProcessEnv in
        # smp_core/runtime.h), which smp::init uses too.
        e = _C.process_env({k: env[k] for k in _PROCESS_ENV_VARS if k in env})
        rank, world, local_rank, local_size = e.rank, e.world_size, e.local_rank, e.local_size
        if e.torchelastic:
            # See Note [Keys per torchrun attempt].
            attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
            return WorldEnv("torchelastic", rank, world, local_rank, local_size,
                            key_prefix=f"smp/torchelastic/attempt_{attempt}/")
        if world == 1:
            return WorldEnv("env", rank, world, local_rank, local_size)
        return WorldEnv("env", rank, world, local_rank, local_size, e.master_addr,
                        e.master_port)
    if env.get("OMPI_COMM_WORLD_RANK") not in (None, ""):
        return _openmpi(env)  # See Note [Open MPI before SLURM]
    if env.get("SLURM_PROCID") not in (None, ""):
        return _slurm(env)
    return WorldEnv("single", 0, 1, 0, 1)


def _openmpi(env):
    who = (f"but OMPI_COMM_WORLD_RANK={env['OMPI_COMM_WORLD_RANK']} is (a script started "
           "by mpirun needs OMPI_COMM_WORLD_SIZE, _LOCAL_RANK and _LOCAL_SIZE)")
    rank = _int(env, "OMPI_COMM_WORLD_RANK", who)
    world = _int(env, "OMPI_COMM_WORLD_SIZE", who)
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", who)
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", who)
    if world == 1:
        return WorldEnv("openmpi", rank, world, local_rank, local_size)
    addr = env.get("MASTER_ADDR")
    if not addr:
        if local_size != world:
            raise ConfigError(
                f"smp: environment MASTER_ADDR is not set, and mpirun started {world} ranks "
                f"on several nodes (OMPI_COMM_WORLD_SIZE={world}, "
                f"OMPI_COMM_WORLD_LOCAL_SIZE={local_size}); Open MPI does not name rank 0's "
                "host: set MASTER_ADDR (mpirun -x MASTER_ADDR=<host of rank 0>)")
        addr = "127.0.0.1"
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("OMPI_MCA_orte_ess_jobid") or ""
    return WorldEnv("openmpi", rank, world, local_rank, local_size, addr, _master_port(env),
                    f"smp/openmpi/{job}/" if job else "smp/openmpi/")


def _slurm(env):
    who = (f"but SLURM_PROCID={env['SLURM_PROCID']} is (a script started by srun needs "
           "SLURM_NTASKS and SLURM_LOCALID)")
    rank = _int(env, "SLURM_PROCID", who)
    world_var = "SLURM_NTASKS" if env.get("SLURM_NTASKS") else "SLURM_NPROCS"
    if not env.get(world_var):
        raise ConfigError(f"smp: environment SLURM_NTASKS is not set, {who}")
    world = _int(env, world_var, who)
    local_rank = _int(env, "SLURM_LOCALID", who)
    nnodes = _int(env, "SLURM_STEP_NUM_NODES", who,
                  default=_int(env, "SLURM_NNODES", who, default=1))
    node = _int(env, "SLURM_NODEID", who, default=0)
    local_size = None
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            local_size = _tasks_on_node(env[name], node, name)
            break
    if local_size is None:
        if nnodes != 1:
            raise ConfigError(
                f"smp: environment SLURM_STEP_TASKS_PER_NODE is not set and SLURM_NNODES="
                f"{nnodes}: cannot tell how many ranks run on node {node} (set "
                "SLURM_STEP_TASKS_PER_NODE, or LOCAL_WORLD_SIZE with RANK and WORLD_SIZE)")
        local_size = world
    if world == 1:
        return WorldEnv("slurm", rank, world, local_rank, local_size)
    addr = env.get("MASTER_ADDR")
    if not addr:
        if nnodes == 1:
            addr = "127.0.0.1"
        else:
            name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                     "SLURM_NODELIST") if env.get(n)), None)
            if name is None:
                raise ConfigError(
                    f"smp: environment MASTER_ADDR is not set and srun started {world} ranks "
                    f"on {nnodes} nodes with no SLURM_JOB_NODELIST to take rank 0's host "
                    "from: set MASTER_ADDR")
            addr = first_slurm_host(env[name])
            if not addr:
                raise ConfigError(f"smp: cannot parse {name}='{env[name]}' (expected e.g. "
                                  "node[01-04],gpu5); set MASTER_ADDR")
    step = f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
    return WorldEnv("slurm", rank, world, local_rank, local_size, addr, _master_port(env),
                    f"smp/slurm/{step}/")


def _tasks_on_node(text, node, name):
    """Tasks on node `node` from SLURM's compressed per-node counts ("2(x3),1"), by
    smprun's own parser (launcher/scheduler_env.cpp, bound as smp._C)."""
    count = _C.slurm_tasks_on_node(text, node)
    if count is None:
        raise ConfigError(f"smp: cannot use {name}='{text}' for SLURM_NODEID={node} "
                          "(expected per-node counts like 2(x3),1 covering every node)")
    return count


def first_slurm_host(nodelist):
    """First host of a SLURM hostlist by smprun's own parser ("node[01-04,07],gpu5" ->
    "node01", "rack[1-2]-n[1,3]" -> "rack1-n1"); "" when malformed."""
    return _C.first_slurm_host(nodelist)


def rendezvous(world_env, timeout_s, wait_for_listener):
    """The c10d store of this job; blocks until rank 0's store is reachable.

    Args:
        world_env: from `from_environment`.
        timeout_s: bound of the connection (and of the store's later waits).
        wait_for_listener: callable(addr, port, timeout_s) that returns once rank 0's
            store accepts connections (smp.runtime's fast poll).

    Raises:
        ConfigError: rank 0 cannot host the store on MASTER_PORT (the port is taken).
    """
    e = world_env
    if e.world_size == 1:
        return dist.HashStore()
    key = (e.source, e.rank, e.world_size, e.master_addr, e.master_port, e.key_prefix)
    if key not in _stores:
        _stores[key] = _connect(e, timeout_s, wait_for_listener)
    store = _stores[key]
    store.set_timeout(timedelta(seconds=timeout_s))
    # See Note [Re-initialisation].
    generation = next(_generations)
    prefix = e.key_prefix + (f"smp/init_{generation}/" if generation else "")
    return dist.PrefixStore(prefix, store) if prefix else store


# Note [Keys per torchrun attempt]: torchrun's agent keeps one store for the whole job
# and restarts the workers on it. torch 1.13's env:// handler prefixed the agent's store
# with "/worker/attempt_<restart>" for them; torch 2.15's does not ("a new TCPStore for
# every retry" says its comment, but the agent's store and its keys stay), so a restarted
# worker read the previous attempt's init keys: "config 'microbatches' differs across
# ranks" or a dead Gloo peer's address. smp's own keys therefore carry
# TORCHELASTIC_RESTART_COUNT, whatever torch does (test_torchrun_restart_gets_a_fresh_store).


def _connect(e, timeout_s, wait_for_listener):
    timeout = timedelta(seconds=timeout_s)
    if e.source == "torchelastic":
        # TORCHELASTIC_USE_AGENT_STORE=True: every worker is a client of the agent's
        # store (torch 1.13 prefixes it per attempt, 2.x does not: Note [Keys per torchrun
        # attempt]); otherwise rank 0 hosts at MASTER_ADDR:MASTER_PORT.
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        return store
    if e.rank != 0:
        wait_for_listener(e.master_addr, e.master_port, timeout_s)
    try:
        # No waiting for workers here: the config exchange names any rank that is missing.
        return dist.TCPStore(e.master_addr, e.master_port, e.world_size, e.rank == 0,
                             timeout, wait_for_workers=False)
    except RuntimeError as exc:
        if e.rank == 0 and "in use" in str(exc):
            raise ConfigError(
                f"smp: rank 0 cannot host the store on port {e.master_port} ({exc}); "
                "another job or a launcher's own store holds it: set MASTER_PORT to a free "
                "port") from exc
        raise


# Note [Re-initialisation]: smp.init after smp.shutdown in the same processes (every
# rank does both, so they count alike) keeps the job's store: rank 0 hosting a new one
# on the same port would race with peers still connected to the old one, and torchrun's
# agent store outlives any init anyway. So the connection is made once per process and
# kept, and each init after the first works under its own key prefix, never meeting
# the previous init's keys.
_stores = {}
_generations = itertools.count()
