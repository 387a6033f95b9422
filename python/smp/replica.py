"""The replica part of `smp.DistributedModel`: this rank's share of the data-parallel
reduction (docs/data_parallel.md).

`DistributedModel` is composed of two parts, each with the interface below and no
attribute of the other read across files:
- `Replica` (here): the dp reducer (`smp._C.Reducer`), its comm hook, the first-use
  order its buckets follow, and the join state of the replica. The step policy (the
  broadcasts that keep the replicas equal, which steps synchronize, arming and
  finalizing the reducer, what a failed step tells the other replicas) is
  `smp._C.ReplicaStep` (smp_core/replica_step.h), the one smp::DistributedModel uses
  too; `step` here is that object, given this rank's tensors and reducer.
- `PipelinePart` (smp/model_pipeline.py): the trace, the partition, the pipeline
  engine and the tied weights, for partitions > 1.
smp/join.py drives the replica's collectives through this interface.
"""
import smp._C as _C
from smp import auto_resume, log
from smp.collectives import allgather
from smp.ddp_comm_hooks import _install
from smp.groups import CommGroup, get_dp_process_group, get_rdp_process_group
from smp.process_state import state
from smp.ranks import dp_rank, dp_size, get_dp_group, rank

__all__ = []

# Note [Failed peer] (smp_core/reducer.cpp): store keys <prefix>/<rank>/<step>.
FAILED_PEER_PREFIX = "smp/failed_peer"


def sliced(params):
    """The tensor-parallel marks of `params`: 1 for a distributed parameter (a slice,
    `_smp_tp_dim`), 0 for a replicated one. The reducer and the first broadcast decide
    what that means (Note [Slices reduce over their rdp group] in
    smp_core/detail/reducer_build.cpp)."""
    return [int(hasattr(p, "_smp_tp_dim")) for p in params]


class Replica:
    """This rank's part of its dp group's reduction.

    Args:
        local_parameters: callable -> this rank's parameters (the model's own, or
            after partitioning the ones its pp rank holds), in a fixed order.
        local_buffers: callable -> this rank's buffers.
        bucket_cap_mb, gradient_as_bucket_view, overlapping: the reducer's settings
            (DistributedModel's arguments).
        broadcast_buffers, backward_passes_per_step: the step policy's settings
            (DistributedModel's arguments).
    """

    def __init__(self, local_parameters, local_buffers, bucket_cap_mb,
                 gradient_as_bucket_view, overlapping, broadcast_buffers=True,
                 backward_passes_per_step=1):
        self._local_parameters = local_parameters
        self._local_buffers = local_buffers
        self._bucket_cap_mb = bucket_cap_mb
        self._gradient_as_bucket_view = gradient_as_bucket_view
        self._overlapping = overlapping
        self.reducer = None            # smp._C.Reducer, made at the first reducing step
        self.comm_hook = None          # (state, hook) registered before the first step
        # Note [Sharded optimizer state]: the division of the parameters between the dp
        # group (smp/optimizer_sharding.py), set at partitioning; None: not sharded.
        self.shard = None
        self._first_use_order = None
        self._record_handles = ()
        # Join (smp/join.py): average over the initial dp size or the ranks still
        # training, and, with partitions > 1, whether a pp peer saw every replica join.
        self.divide_by_initial_world_size = True
        self.pipeline_join_done = False
        # The step policy (smp_core/replica_step.h), shared with smp::DistributedModel.
        self.step = _C.ReplicaStep(get_dp_process_group(), reduces=self.reduces,
                                   broadcast_buffers=broadcast_buffers,
                                   backward_passes_per_step=backward_passes_per_step)
        # Note [Failed peer]: a replica that fails a step with no reduction posts it.
        self.step.set_failure_post(state.store, FAILED_PEER_PREFIX, rank(), dp_rank())

    @property
    def reduces(self):
        """Whether this replica reduces gradients (config 'ddp' and more than one
        replica)."""
        return state.cfg.ddp and dp_size() > 1

    def params(self):
        """The parameters the reducer reduces: this rank's that require grad."""
        return [p for p in self._local_parameters() if p.requires_grad]

    def sync_before_forward(self):
        """dp rank 0's parameters and buffers on every replica before the first forward
        (a tp slice: rdp rank 0's, over the rdp group), its buffers before later ones
        (when broadcast_buffers): the step policy's decision (smp_core/replica_step.h)."""
        params = list(self._local_parameters())
        return self.step.sync_before_forward(params, list(self._local_buffers()),
                                             sliced(params), get_rdp_process_group())

    def broadcasts_buffers(self):
        """Whether the next forward's sync broadcasts the buffers (Join broadcasts them
        from its own root, smp/join.py)."""
        return self.step.forward_sync(self.has_buffers()) == _C.ForwardSync.buffers

    def has_buffers(self):
        return any(True for _ in self._local_buffers())

    def prepare_for_backward(self, tensors):
        """Before a backward of the current microbatch (pp=1): the reducer armed when the
        microbatch is the last of a synchronized step."""
        self.step.prepare_for_backward(self.ensure_reducer(), list(tensors))

    def end_step(self):
        """After the step's body (pp=1): the reducer finalized if the step armed it."""
        self.step.end_step(self.reducer)

    # Note [Bucket order from the first iteration]: during the first microbatch of the
    # first step, forward pre-hooks record the order in which modules first run; the
    # reverse of their parameters' order is when gradients will become ready, so the
    # reducer's buckets match backward from step one. dp rank 0's order is used on all.
    def record_first_use(self, module):
        """Starts recording the order `module`'s submodules first use this rank's
        parameters (once, before the reducer exists)."""
        if self.reducer is not None or self._first_use_order is not None or not self.reduces:
            return
        order, seen, handles = [], set(), []
        index = {id(p): i for i, p in enumerate(self.params())}

        def pre_hook(m, _inputs):
            for p in m.parameters(recurse=False):
                if id(p) in index and id(p) not in seen:
                    seen.add(id(p))
                    order.append(index[id(p)])
        for m in module.modules():
            handles.append(m.register_forward_pre_hook(pre_hook))
        self._first_use_order = order
        self._record_handles = handles

    def stop_recording(self):
        for h in self._record_handles:
            h.remove()
        self._record_handles = ()

    def ensure_reducer(self):
        """Makes the reducer (every dp rank at the same step): buckets in the recorded
        first-use order (dp rank 0's), the registered comm hook installed, a resumed
        job's bucket layout adopted, and peers' posted failures watched."""
        if self.reducer is not None:
            return self.reducer
        self.stop_recording()
        params = self.params()
        used = list(self._first_use_order or [])
        rest = [i for i in range(len(params)) if i not in set(used)]
        expected = list(reversed(used + rest))
        expected = allgather(expected, CommGroup.DP_GROUP)[0]  # dp rank 0 decides
        self.reducer = _C.Reducer(
            params, get_dp_process_group(), bucket_cap_mb=self._bucket_cap_mb,
            gradient_as_bucket_view=self._gradient_as_bucket_view,
            overlapping=self._overlapping, expected_order=expected,
            timeout_s=state.cfg.timeout_s,
            owners=self.shard.grad_owners() if self.shard is not None else [],
            sliced=sliced(params), slice_group=get_rdp_process_group(),
            prescaled_batch=bool(getattr(state.cfg, "prescaled_batch", False)))
        shape = self.reducer.hierarchy()  # Note [Hierarchical reduction]: said once
        if shape and dp_rank() == 0:
            log.get_logger().info("smp: %s", shape)
        if self.comm_hook is not None:
            _install(self.reducer, *self.comm_hook)
        auto_resume.adopt_layout(self.reducer)  # a resumed job's buckets, if any
        # Note [Failed peer]: a replica that fails a step with no reduction posts it.
        dp_peers = [r for r in get_dp_group() if r != rank()]
        self.reducer.watch_peer_failures(state.store, FAILED_PEER_PREFIX, dp_peers)
        return self.reducer

    def fail_step(self, sync_step, error, armed):
        """This rank's step failed (a bad input, or its body raised; pp=1 and pp>1): the
        dp replicas are told in the step's own collectives, and raise naming this rank,
        instead of waiting for it (Note [Failed rank] in
        smp_core/detail/reducer_shadow.cpp): a flagged shadow step, or, once the reducer
        was `armed` (backward had begun), the rest of the step, flagged. A step that does
        not reduce has no collectives to tell them in: it posts the failure for the step
        they will wait in (Note [Failed peer]). Decided by ReplicaStep.fail_step."""
        lines = str(error).splitlines() if error is not None else []
        what = lines[0] if lines else "an error"
        return self.step.fail_step(self.reducer, bool(sync_step), bool(armed),
                                   f"{type(error).__name__}: {what}")
