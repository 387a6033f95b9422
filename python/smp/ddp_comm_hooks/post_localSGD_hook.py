"""Post-local SGD (Lin et al., 2020, https://arxiv.org/abs/1808.07217) with torch's API
(torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook).

Gradients are averaged over `process_group` for the first `start_localSGD_iter` steps,
then over `subgroup` only (or not at all); a model averager (torch's
PeriodicModelAverager) run after the optimizer step keeps the replicas close. Every
branch is one of smp's C++ hooks (allreduce or noop), issued from the comm thread.

Unlike torch's, the default subgroups are made when the state is built (a collective
on the main thread, every rank), never inside the hook, where torch's makes them.
"""
import os

import torch.distributed as dist

from smp import process_state
from smp._C import ConfigError
from smp.ddp_comm_hooks._builtin import run
from smp.ddp_comm_hooks.debugging_hooks import noop_hook
from smp.ddp_comm_hooks.default_hooks import allreduce_hook
from smp.ranks import local_size, size

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]


def _node_subgroup(process_group):
    """This rank's subgroup of the ranks of `process_group` (None: smp's dp group, or
    the world without smp) on its node. Every rank of the world must call it."""
    if process_state.is_initialized():
        local = local_size()
        topo = process_state.state.topology
        groups = {tuple(sorted(topo.dp_group(r))) for r in range(size())}
        if process_group is not None and sorted(dist.get_process_group_ranks(
                process_group)) not in [list(g) for g in groups]:
            groups = {tuple(sorted(dist.get_process_group_ranks(process_group)))}
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        pg = process_group or dist.group.WORLD
        groups = {tuple(sorted(dist.get_process_group_ranks(pg)))}
    subgroups = []
    for g in sorted(groups):
        nodes = {}
        for r in g:
            nodes.setdefault(r // local, []).append(r)
        subgroups.extend(nodes[n] for n in sorted(nodes))
    # Every rank makes every subgroup, in one order (torch's new_subgroups_by_enumeration
    # does the same, but in torch 1.13 only with CUDA).
    me, mine = dist.get_rank(), None
    for ranks in subgroups:
        group = dist.new_group(ranks)
        if me in ranks:
            mine = group
    return mine


class PostLocalSGDState:
    """The state of post_localSGD_hook (torch's PostLocalSGDState).

    Args:
        process_group: group for the first start_localSGD_iter steps; None: smp's dp
            group (torch's default group under torch's DDP).
        subgroup: group afterwards; None: the ranks of `process_group` on this node
            (made here: every rank must build its state at the same point).
        start_localSGD_iter: steps of global averaging (>= 0).
        post_local_gradient_allreduce: False: no gradient communication at all once
            local SGD started.

    Raises:
        smp.ConfigError: start_localSGD_iter is not an int >= 0.
    """

    __slots__ = ["process_group", "subgroup", "start_localSGD_iter",
                 "post_local_gradient_allreduce", "iter"]

    def __init__(self, process_group, subgroup, start_localSGD_iter,
                 post_local_gradient_allreduce=True):
        if isinstance(start_localSGD_iter, bool) or not isinstance(start_localSGD_iter, int) \
                or start_localSGD_iter < 0:
            raise ConfigError(f"smp: PostLocalSGDState start_localSGD_iter="
                              f"{start_localSGD_iter!r} must be an int >= 0")
        self.process_group = process_group
        self.subgroup = subgroup if subgroup is not None else _node_subgroup(process_group)
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = bool(post_local_gradient_allreduce)
        self.iter = 0

    def maybe_increase_iter(self, bucket):
        """Counts a step at its last bucket."""
        if bucket.is_last():
            self.iter += 1


def post_localSGD_hook(state, bucket):
    """Averages over state.process_group before state.start_localSGD_iter steps, then
    over state.subgroup (or returns the bucket unreduced if
    post_local_gradient_allreduce is False)."""
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return run(allreduce_hook, state.process_group, bucket)
    if not state.post_local_gradient_allreduce:
        return run(noop_hook, None, bucket)
    return run(allreduce_hook, state.subgroup, bucket)
