"""smp.init and smp.shutdown: the process's smp runtime (C++: smp_core/runtime.h).

The C++ core (``smp._C``) validates the config, checks that every rank agrees on it,
computes the rank layout and moves the bytes; init resolves where the config comes
from (smp/config_source.py) and where this process sits (smp/launch_env.py), meets its
peers on the store, creates the ``torch.distributed`` groups (smp/groups.py) and hands
all of it to C++ (``_C.install``), then fills ``smp.state`` (smp/process_state.py).
"""
import atexit
import datetime
import json
import logging
import os
import socket
import sys
import time
from types import SimpleNamespace

import torch.distributed as dist

import smp._C as _C
from smp import auto_resume, collectives, launch_env, log
from smp.config_source import config_text, timeout_of
from smp.groups import choose_backend, create_groups, event_driven_group_barrier
from smp.process_state import state
from smp.timeline import timeline

__all__ = []


def _wait_for_listener(addr, port, timeout_s):
    """Returns once rank 0's store accepts connections (bounded by timeout_s).

    torch's TCPStore client sleeps a whole second after a refused connection, so ranks
    that start together with rank 0 (the usual case under smprun) would each lose ~1 s
    in smp.init. A plain connect, retried every few ms, finds the listener first; the
    store then connects at once. A timeout here is left to the store's own connect,
    which reports it.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.002
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return
        except OSError:
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def _fix_mmap_threshold():
    """Note [Fixed mmap threshold] (smp_core/runtime.h): 4 MiB unless SMP_MMAP_THRESHOLD
    (bytes; 0 keeps glibc's adaptive threshold) says otherwise, or the job set glibc's
    own (MALLOC_MMAP_THRESHOLD_, or GLIBC_TUNABLES' glibc.malloc.mmap_threshold). Before the process groups, so that every thread smp
    starts sees it."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or \
            "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    threshold = _C.env_int("SMP_MMAP_THRESHOLD", 4 << 20)
    if threshold < 0:
        raise _C.ConfigError(f"smp: environment SMP_MMAP_THRESHOLD={threshold} is not a number "
                          "of bytes >= 0 (0: glibc's adaptive threshold)")
    if threshold > 0:
        _C.set_malloc_mmap_threshold(threshold)


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
    _fix_mmap_threshold()
    raw = config_text(config)
    timeout_s = timeout_of(raw)
    timeout = datetime.timedelta(seconds=timeout_s)

    if dist.is_initialized():
        # The script initialised torch.distributed itself: join its world and store.
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = _C.env_int("LOCAL_RANK", rank)
        local_size = _C.env_int("LOCAL_WORLD_SIZE", world)
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

    cfg_json = _C.agree_config(store, rank, world, raw)  # sets the job key first
    if rank == 0 and world > 1 and not _C.job_secret_from_environment():
        # A warning where strangers on other hosts could reach the store; on one host
        # (the store on loopback) a DEBUG line.
        level = logging.WARNING if local_size < world else logging.DEBUG
        log.get_logger().log(level,
            "smp: no SMP_JOB_SECRET: this job's connections are authenticated with a key "
            "drawn by rank 0 and shared through the c10d store, so anyone who can reach the "
            "store can join them. smprun sets one per job; under torchrun or srun export "
            "SMP_JOB_SECRET=$(openssl rand -hex 32) on every node (docs/security.md).")
    cfg = json.loads(cfg_json)
    if world > 1:
        _choose_interface(local_rank)
    topo = _C.Topology(world, cfg["partitions"], cfg["placement_strategy"],
                       cfg["tensor_parallel_degree"])
    topo.check_tp_hosts(store, rank, timeout_s)  # Note [A tp group on one host]
    with event_driven_group_barrier():
        if not dist.is_initialized():
            dist.init_process_group(choose_backend(cfg["backend"]), store=store, rank=rank,
                                    world_size=world, timeout=timeout)
        groups = create_groups(topo, rank, world, timeout)
    tp = topo.tp_size > 1  # Note [Groups under tensor parallelism]
    _C.install(cfg_json, rank, world, local_rank, local_size, store,
               groups["world"], groups["pp"], groups["dp"],
               groups["tp"] if tp else None, groups["rdp"] if tp else None,
               groups["mp"] if tp else None)
    beating = _C.start_liveness()  # Note [Rank heartbeat] (smp_core/liveness.cpp)
    if beating and rank == 0:
        log.get_logger().log(logging.WARNING if beating.startswith("no ") else logging.INFO,
                             "smp: %s", beating)
    state.cfg = SimpleNamespace(**cfg)
    state.topology = topo
    state.rank, state.world_size = rank, world
    state.local_rank, state.local_size = local_rank, local_size
    state.store = store
    state.groups = groups
    state.initialized = True
    auto_resume.arm()  # Note [Automatic resume]: a checkpoint to continue from, if any
    timeline.start(rank)
    atexit.register(timeline.close)


def _choose_interface(local_rank):
    """Note [Gloo's interface] (smp_core/net_interface.cpp): where this host's name
    resolves to none of its addresses, Gloo would bind loopback and a job across hosts
    could not connect; the interface that routes to the master is used instead, and said
    once a host (by its local rank 0). A user's GLOO_SOCKET_IFNAME always wins."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    name, why = _C.choose_gloo_interface(master)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        if local_rank == 0:
            log.get_logger().info("smp: Gloo binds %s: %s", name, why)


def _quiesce_native_threads():
    """No native thread may need the GIL once the interpreter finalizes (Note [Python
    hooks at exit] in python/csrc/bind_reducer.cpp): a Gloo thread that completed a
    Python comm hook's future drops the hook's callback right after; wait for that,
    the GIL released."""
    try:
        _C.quiesce_python_hooks(2.0)
    except Exception:  # never let the exit path raise
        pass


# Teardown hooks of the layers above (the asynchronous saves of smp/checkpoint: Note
# [Asynchronous save]): fn(how), how = "shutdown" (smp.shutdown(): may raise), "exit"
# (the interpreter exits after a clean run) or "failed" (it exits after an error).
_teardown_hooks = []


def register_teardown(fn):
    _teardown_hooks.append(fn)


def shutdown():
    """Tears down smp's groups (tests and scripts that re-initialise; at exit, smp does
    it for a script that did not, see _at_exit)."""
    if not state.initialized:
        return
    failed = None
    for fn in _teardown_hooks:
        try:
            fn("shutdown")
        except Exception as e:  # noqa: BLE001  (raised after the teardown)
            failed = failed or e
    if state.model is not None:
        state.model._shutdown()
    _quiesce_native_threads()
    timeline.close()
    _C.stop_liveness()  # Note [Rank heartbeat]: this rank ended normally
    _C.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    state.__init__()
    if failed is not None:
        raise failed


# Note [Clean exit]: a native thread that needs the GIL after the interpreter began to
# finalize is ended by CPython with pthread_exit, whose forced unwind aborts the
# process ("terminate called without an active exception", SIGABRT) after a job that
# succeeded. Two such threads were caught with cores, both Gloo workers
# (c10d::ProcessGroupGloo::runLoop): one dropping a Python comm hook's callback after
# completing its future (Note [Python hooks at exit]), one destroying a finished
# allreduce's work object, whose tensor's Python object needs the GIL to be freed
# (`dist.all_reduce(t)` as a script's last line). So at exit, before finalization:
# the hooks' callbacks are waited for; ranks waiting for this one are told it exited;
# and, after a script that ended cleanly without smp.shutdown(), smp shuts down:
# torch.distributed's groups are destroyed, which joins each Gloo group's worker
# threads (torch destroys a group with the GIL released), and the pipeline's and the
# reducers' threads stop. After a failure the groups are left to the process's end:
# a collective the failed rank left behind could keep the join waiting.
def _at_exit():
    clean = state.initialized and getattr(sys, "last_value", None) is None
    for fn in _teardown_hooks:
        try:
            fn("exit" if clean else "failed")
        except Exception:  # noqa: BLE001  (never let the exit path raise)
            pass
    _quiesce_native_threads()
    collectives.mark_exited()
    if state.initialized and getattr(sys, "last_value", None) is None:
        try:
            shutdown()
        except Exception:  # never let the exit path raise
            pass


atexit.register(_at_exit)
