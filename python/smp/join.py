"""Join for uneven inputs: `smp.join.Join`, `Joinable`, `JoinHook` (docs/join.md).

The generic context manager follows torch 1.13's `torch.distributed.algorithms.join`:
each iteration an active rank's first Joinable notifies the context ("not joined"
allreduce); a rank whose inputs ran out runs its Joinables' main hooks once per
iteration, shadowing its peers' collectives, until every rank has joined; then every
rank runs the post hooks, told whether it was among the last to join.

The collectives are the C++ `smp._C.JoinProtocol`'s, issued from the training thread
between steps, when the reducer's comm queue is idle (see Note [Join collective order]
in smp_core/join.h), on the dp process group.

The model's join (`DistributedModel.join_hook`) adds, per iteration, decided in C++
(Note [Join step] in smp_core/join_step.cpp):
  1. buffers (broadcast_buffers): the common-rank allreduce and the broadcast from it;
  2. the reducer (made at the same point on every rank), then the "sync" allreduce:
     how many ranks reduce gradients this step (1 each);
  3. the reducer's step; a joined rank runs `Reducer.run_shadow_step()`, which sends
     every bucket through the registered hook chain with zeros.
With partitions > 1 each pp rank does this on its own dp group; the driver (pp rank 0)
decides its replica's join state and tells its pp peers with each step (see
Note [Join with pipeline parallelism]). Under tensor_parallel_degree > 1 the tp ranks of
a replica join together (else a ConfigError on every rank), a shadow step's buckets go
over the dp and rdp groups as a real step's, and the final parameters' tp slices come
over the rdp group (Note [Join under tensor parallelism] in smp_core/join.cpp).
"""
import abc
import warnings
from typing import NamedTuple

import torch

import smp._C as _C
from smp import optimizer_sharding
from smp.collectives import STEP_CALL, api_call
from smp.groups import get_dp_process_group, get_rdp_process_group
from smp.process_state import is_initialized, state
from smp.ranks import get_dp_group, pp_rank, pp_size, tp_size

__all__ = ["Join", "Joinable", "JoinHook"]


class JoinHook:
    """Two entry points of the join context: `main_hook()`, called once per iteration
    while some rank has not joined (shadow the iteration's collectives), and
    `post_hook(is_last_joiner)`, called once after every rank joined."""

    def main_hook(self):
        """Shadows one iteration's collectives of the ranks still training."""

    def post_hook(self, is_last_joiner: bool):
        """Runs once every rank joined; `is_last_joiner`: this rank joined last."""


class _JoinConfig(NamedTuple):
    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool

    @staticmethod
    def construct_disabled_join_config():
        return _JoinConfig(enable=False, throw_on_early_termination=False,
                           is_first_joinable=False)


class Joinable(abc.ABC):
    """A class usable in `Join`: implements `join_hook(**kwargs)`, `join_device` and
    `join_process_group`, calls `Joinable.__init__(self)`, and calls
    `Join.notify_join_context(self)` before its per-iteration collectives."""

    @abc.abstractmethod
    def __init__(self):
        super().__init__()
        self._join_config = _JoinConfig.construct_disabled_join_config()

    @abc.abstractmethod
    def join_hook(self, **kwargs) -> JoinHook:
        """The JoinHook for this joinable; `kwargs` are the Join's extra arguments."""

    @property
    @abc.abstractmethod
    def join_device(self) -> torch.device:
        """Device of the join collectives' tensors."""

    @property
    @abc.abstractmethod
    def join_process_group(self):
        """Process group of the join collectives."""


_protocols = {}


def _protocol(pg):
    """The JoinProtocol of `pg` (one per group, so its iteration count is the group's).
    On the dp group under tensor parallelism it knows each rank's replica (Note [Join
    under tensor parallelism] in smp_core/join.cpp)."""
    held = _protocols.get(id(pg))
    if held is None or held[0] is not pg:
        dp = is_initialized() and pg is get_dp_process_group()
        rdp = is_initialized() and not dp and pg is get_rdp_process_group()
        proto = _C.JoinProtocol(pg, group_name="dp" if dp else "rdp" if rdp else "join")
        if dp and tp_size() > 1:
            proto.set_replicas([state.topology.rdp_rank(r) for r in get_dp_group()],
                               tp_size())
        held = (pg, proto)
        _protocols[id(pg)] = held
    return held[1]


# torch 1.13's texts (torch/distributed/algorithms/join.py), so code written against
# torch's Join matches them: the rank that ran out names itself by its group rank, the
# others raise the "detected" text.
def _exhausted_error(proto):
    return RuntimeError(f"Rank {proto.rank} exhausted all inputs.")


def _detected_error():
    return RuntimeError("Detected at least one rank that exhausted inputs. "
                        "Throwing across all ranks.")


class Join:
    """Context manager for training with uneven inputs across ranks.

    Args:
        joinables: the participating Joinables (e.g. `[model, optimizer]`); their hooks
            run in this order. All must share one process group.
        enable: False turns the context off (inputs known to be even).
        throw_on_early_termination: raise on every rank as soon as one rank runs out of
            inputs, instead of shadowing.
        **kwargs: passed to every `join_hook()` (e.g. divide_by_initial_world_size).

    Raises:
        ValueError: no joinables, joinables on different process groups, or no
            joinable that notifies the context each step (a DistributedOptimizer alone).
        RuntimeError: with throw_on_early_termination, once a rank has run out: on that
            rank "Rank R exhausted all inputs." (R its rank in the group), on the others
            "Detected at least one rank that exhausted inputs. Throwing across all
            ranks." (torch's texts).
    """

    def __init__(self, joinables, enable=True, throw_on_early_termination=False, **kwargs):
        joinables = list(joinables)
        if not joinables:
            raise ValueError("smp.join.Join: joinables=[] (the join context manager requires "
                             "at least one joinable)")
        for j in joinables:
            for attr in ("join_hook", "join_device", "join_process_group", "_join_config"):
                if not hasattr(j, attr):
                    raise ValueError(f"smp.join.Join: {type(j).__name__} object has no "
                                     f"'{attr}' (a Joinable calls Joinable.__init__ and "
                                     "implements join_hook, join_device, join_process_group)")
        if enable:
            if optimizer_sharding.enabled():
                # A joined rank would miss the broadcasts of its shard's parameters.
                raise _C.ConfigError(
                    "smp.join.Join: config 'shard_optimizer_state'=true is not supported "
                    "with uneven inputs (Join) yet; set it to false, or give every rank "
                    "the same number of batches")
        self._joinables = joinables
        self._join_hooks = [j.join_hook(**kwargs) for j in joinables]
        self._enable = bool(enable)
        self._throw_on_early_termination = bool(throw_on_early_termination)
        self._set_joinable_configs()
        self._extract_dist_info()

    def _set_joinable_configs(self):
        # The notifier must be a joinable that calls notify_join_context before its
        # collectives each iteration. DistributedOptimizer has no per-step collective
        # and steps after the model, so it never notifies (see docs/join.md).
        notifier = next((j for j in self._joinables if not getattr(j, "_smp_join_passive", False)),
                        None)
        if notifier is None and self._enable:
            raise ValueError("smp.join.Join: every joinable is a DistributedOptimizer, which "
                             "issues no per-step collective; pass the model too: "
                             "Join([model, optimizer])")
        for j in self._joinables:
            j._join_config = _JoinConfig(self._enable, self._throw_on_early_termination,
                                         j is notifier)
            j._smp_join_context = self  # a pipeline peer runs the hooks from its step

    def _extract_dist_info(self):
        pg, device = None, None
        for j in self._joinables:
            if pg is None:
                pg = j.join_process_group
            elif pg is not j.join_process_group and pg != j.join_process_group:
                raise ValueError("smp.join.Join: the joinables use different process groups "
                                 "(all must use the same one, e.g. the dp group)")
            if device is None:
                device = j.join_device
        self._process_group = pg
        self._device = device

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if not self._enable or exc_type is not None:
                return  # an exception propagates as it is
            model = _pipelined_model(self._joinables)
            if model is not None and pp_rank() > 0:
                _peer_join_loop(model)  # Note [Join with pipeline parallelism]
                return
            proto = _protocol(self._process_group)
            all_joined, is_last_joiner, i = False, True, 0
            while not all_joined:
                if i == 1000:
                    warnings.warn(f"smp.join: rank {proto.rank} of the dp process group has at "
                                  "least 1000 fewer inputs than the ranks still training")
                if proto.count_not_joined() == 0:
                    all_joined = True
                    if model is not None:
                        _pp_announce(model, "done", is_last_joiner)
                else:
                    if model is not None:
                        _pp_announce(model, "shadow")
                    if self._throw_on_early_termination:
                        proto.check_early_termination(True)  # tells the active ranks
                        raise _exhausted_error(proto)
                    for hook in self._join_hooks:
                        hook.main_hook()
                    is_last_joiner = False
                    i += 1
            for hook in self._join_hooks:
                hook.post_hook(is_last_joiner)
        finally:
            self._disable()

    def _joined_iteration(self, proto):
        """A pipeline peer's shadow iteration, after its count_not_joined."""
        if self._throw_on_early_termination:
            proto.check_early_termination(True)
            raise _exhausted_error(proto)
        for hook in self._join_hooks:
            hook.main_hook()

    def _disable(self):
        for j in self._joinables:
            j._join_config = _JoinConfig.construct_disabled_join_config()
            j._smp_join_context = None

    @staticmethod
    def notify_join_context(joinable):
        """Tells the context that this rank has not joined; call before the joinable's
        per-iteration collectives. Only the first joinable communicates.

        Returns:
            The number of ranks still training (this one included) if `joinable` is the
            context's notifier, else None.

        Raises:
            RuntimeError: throw_on_early_termination=True and some rank has joined.
        """
        cfg = getattr(joinable, "_join_config", None)
        if cfg is None:
            raise ValueError(f"smp.join: {type(joinable).__name__} has no _join_config (its "
                             "constructor must call Joinable.__init__)")
        if not cfg.enable or not cfg.is_first_joinable:
            return None
        proto = _protocol(joinable.join_process_group)
        active = proto.notify_not_joined()
        if cfg.throw_on_early_termination and proto.check_early_termination(False):
            raise _detected_error()
        return active


# --- the model and the optimizer as joinables -------------------------------------------

def _in_join(model):
    cfg = getattr(model, "_join_config", None)
    return cfg is not None and cfg.enable


class _ModelJoinHook(JoinHook):
    def __init__(self, model, divide_by_initial_world_size=True):
        if not isinstance(divide_by_initial_world_size, bool):
            raise ValueError("smp.join: divide_by_initial_world_size="
                             f"{divide_by_initial_world_size!r} is not one of {{True, False}}")
        self.model = model
        model.replica.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self):
        shadow_step(self.model)

    def post_hook(self, is_last_joiner):
        sync_final_model(self.model, is_last_joiner)


class _OptimizerJoinHook(JoinHook):
    """A DistributedOptimizer's step has no collective: nothing to shadow; the model's
    post hook brings the final parameters."""


def model_join_hook(model, **kwargs):
    # Other kwargs are meant for other joinables of the same context (torch's rule).
    return _ModelJoinHook(model, kwargs.get("divide_by_initial_world_size", True))


def make_optimizer_joinable(opt):
    """Adds the Joinable interface to a DistributedOptimizer (the user's own object)."""
    opt._join_config = _JoinConfig.construct_disabled_join_config()
    opt._smp_join_passive = True
    opt.join_hook = lambda **kwargs: _OptimizerJoinHook()
    opt.join_device = torch.device("cpu")
    opt.join_process_group = get_dp_process_group()


# Active ranks, in DistributedModel._run_step (pp=1) / PipelinePart.run_step:
#   begin_step -> [partition | sync_buffers] -> announce -> body + reducer -> end_step.
# A joined rank's shadow_step issues the same collectives in the same order.

class _StepJoin:
    """The join bookkeeping of one active step."""

    def __init__(self, model):
        self.model = model
        self.proto = _protocol(get_dp_process_group())
        self.sync = False

    def sync_buffers(self):
        _C.join_sync_buffers(self.proto, list(self.model.local_buffers()), True)

    def announce(self, sync_step):
        """The "sync" allreduce; returns whether this step reduces gradients (Note
        [Join step] in smp_core/join_step.cpp)."""
        replica = self.model.replica
        if not replica.reduces:
            return sync_step
        # Made here, before the 'sync' allreduce, not at the first backward: a joined
        # rank makes it at the same point (Note [Join step] in smp_core/join_step.cpp).
        self.sync = _C.join_announce_step(self.proto, replica.ensure_reducer(),
                                          bool(sync_step),
                                          bool(replica.divide_by_initial_world_size))
        return self.sync

    def end_step(self, reduced):
        """After the body: a step that announced a reduction but ran no synchronized
        backward (an evaluation step) shadows it, so the group's collectives match."""
        reducer = self.model.replica.reducer
        if reducer is not None:
            _C.join_end_step(reducer, self.sync, bool(reduced))


def begin_step(model):
    """At the start of an active step; returns a _StepJoin, or None outside a Join."""
    if not _in_join(model):
        return None
    Join.notify_join_context(model)
    return _StepJoin(model)


def _has_buffers(model):
    """Whether this iteration broadcasts the buffers (the step policy's decision,
    smp_core/replica_step.h)."""
    return model.replica.broadcasts_buffers()


@api_call(STEP_CALL)  # the collectives of an active rank's step: the same name
def shadow_step(model):
    """A joined rank's iteration: the collectives of an active rank's step."""
    replica = model.replica
    if not replica.reduces:
        return
    proto = _protocol(get_dp_process_group())
    if not model.partitioned:
        if pp_size() > 1:
            raise RuntimeError("smp.join: with partitions > 1 every rank must run at least the "
                               "first step (a replica with zero batches cannot be partitioned)")
        model.first_step_without_batch()  # the first step's agreement and broadcast
    elif _has_buffers(model):
        _C.join_sync_buffers(proto, list(model.local_buffers()), False)
    # The reducer is made where an active rank's announce makes it (Note [Join step]).
    _C.join_shadow_step(proto, replica.ensure_reducer())


def sync_final_model(model, is_last_joiner):
    """Post hook: every rank takes the parameters and buffers of the last joiner (the
    highest dp rank among them). Under tensor parallelism a tp slice (`_smp_tp_dim`)
    comes from the last joiner of its rdp group, the ranks holding the same slice (Note
    [Join under tensor parallelism] in smp_core/join.cpp): the tp ranks of a replica
    join together, so every rdp group has one."""
    replica = model.replica
    if not replica.reduces:
        return
    proto = _protocol(get_dp_process_group())
    params = list(model.local_parameters())
    slices = [p for p in params if hasattr(p, "_smp_tp_dim")] if tp_size() > 1 else []
    sliced_ids = {id(p) for p in slices}
    whole = [p for p in params if id(p) not in sliced_ids]
    tensors = whole + list(model.local_buffers())
    _C.join_sync_final(proto, replica.reducer, tensors, bool(is_last_joiner))
    if slices:  # every rank of the stage has them (the reducer checked the marks)
        _C.join_sync_final(_protocol(get_rdp_process_group()), None, slices,
                           bool(is_last_joiner))


# Note [Join with pipeline parallelism]
# A replica's data is its driver's (pp rank 0), so the driver decides each iteration
# whether its replica trains or has joined, and tells its pp peers at the start of the
# iteration with a step-level message in an epoch of its own (smp_core/p2p.h, Note [Step
# epochs]): "step" (a real step follows), "shadow" (the replica has joined; others have
# not) or "done" (every replica has joined; carries is_last_joiner). Each pp rank then
# runs the join protocol on its own dp group exactly as its driver does on the driver's:
# the groups are disjoint, and every replica's pp ranks are in the same state, so each
# dp group sees the same sequence as the drivers' group. A peer reads the message
# wherever it is: in a step call (its loop still has batches: "shadow" turns the call
# into a shadow iteration that returns None) or in its Join's exit (its loop ran out:
# "step" makes it serve the driver's real step). The first step (partitioning) is
# always a real step on every rank.

SHADOWED = object()  # _run_step's answer when a peer's step call was a shadow iteration


def _pipelined_model(joinables):
    for j in joinables:
        if getattr(j, "pipeline", None) is not None and pp_size() > 1:
            return j
    return None


def _pp_announce(model, state, is_last_joiner=False):
    """Driver: sends this iteration's join state to the pp peers."""
    model.pipeline.engine.send_join_state((state, bool(is_last_joiner)))


def _pp_receive(model):
    """Peer: the driver's join state of this iteration."""
    return model.pipeline.engine.receive_join_state()


def pipeline_begin_step(model):
    """partitions > 1, at the start of a step call: a _StepJoin, None outside a Join, or
    SHADOWED (a peer whose replica has joined: the call was a shadow iteration)."""
    if not _in_join(model):
        return None
    if model.replica.pipeline_join_done:
        raise RuntimeError(f"smp.join: pp rank {pp_rank()} has more batches than its "
                           "pipeline driver (pp rank 0), and every replica has joined")
    if model.pipeline is not None:
        if pp_rank() == 0:
            _pp_announce(model, "step")
        else:
            state, is_last_joiner = _pp_receive(model)
            if state != "step":
                _peer_joined_iteration(model, state, is_last_joiner)
                return SHADOWED
    Join.notify_join_context(model)
    return _StepJoin(model)


def _peer_joined_iteration(model, state, is_last_joiner):
    ctx = model._smp_join_context
    proto = _protocol(ctx._process_group)
    n = proto.count_not_joined()
    if (n == 0) != (state == "done"):
        raise RuntimeError(f"smp.join: pp rank {pp_rank()} counted {n} active replicas "
                           f"on its dp group but its driver says '{state}' (a bug)")
    if state == "shadow":
        ctx._joined_iteration(proto)
        return
    model.replica.pipeline_join_done = True
    for hook in ctx._join_hooks:
        hook.post_hook(is_last_joiner)


@api_call(STEP_CALL)  # it runs the driver's steps
def _peer_join_loop(model):
    """A pp peer whose own loop ran out: follows its driver until every replica joined."""
    try:
        while not model.replica.pipeline_join_done:
            model._run_step(None, None)
    finally:
        model.replica.pipeline_join_done = False
