"""The pipeline part of smp.DistributedModel (partitions > 1): the first step's trace
and partition, and each step run through the pipeline engine with the tied-weight sum
and the dp reduction overlapping the backward. A mixin of DistributedModel: it uses the
model's attributes (see model.py's __init__)."""

import torch

from smp import agreement, core, log, tracer
from smp.nested import map_leaves

__all__ = []


class PipelineMixin:
    def _trace(self, fn, mb_inputs):
        """Runs the first microbatch through the whole model, recording the trace.

        The trace leaves no trace: buffers (BatchNorm statistics, counters) and RNG
        states are restored afterwards, and it runs on a copy of the microbatch's
        tensors, so a module that changes its input in place does not change the
        user's batch before the step proper runs. A failure on any rank raises on
        every rank.
        """
        trace = tracer.Trace(self.module, self.trace_execution_times, self.trace_memory_usage)
        args, kwargs = map_leaves(mb_inputs[0], torch.Tensor.clone,
                                  lambda x: isinstance(x, torch.Tensor))
        restore = agreement.snapshot_side_effects(self.module)
        core.state.tracing = True
        self._in_step = True
        error = None
        try:
            with trace, torch.no_grad():
                fn(*args, **kwargs)
        except Exception as exc:  # reported to every rank below
            error = exc
        finally:
            core.state.tracing = False
            self._in_step = False
            restore()
        mine = trace.nodes() if error is None else None
        everyone = agreement.agree(error, core.CommGroup.WORLD,
                                   agreement.first_error("tracing the model"), value=mine,
                                   own_first=True)
        # pp rank 0's measurements decide (times differ between ranks).
        ref = everyone[core.state.topology.pp_group(core.rank())[0]]
        if [r["name"] for r in ref] != [r["name"] for r in mine]:
            raise RuntimeError(f"smp: the model differs between pp ranks: {len(mine)} modules "
                               f"on pp rank {core.pp_rank()}, {len(ref)} on pp rank 0")
        measured = ("activation_bytes", "time_ms", "mem_bytes", "first_call", "calls")
        return [dict(m, **{k: r[k] for k in measured}) for m, r in zip(mine, ref)]

    def _partition_pipeline(self, fn, mb_inputs):
        from smp import pipeline, placement
        records = self._trace(fn, mb_inputs)
        nodes, plan = tracer.make_plan(records)
        hashes = core.allgather(plan.hash, core.CommGroup.MP_GROUP)
        if len(set(hashes)) != 1:
            raise RuntimeError("smp: ranks of the mp group computed different partitions "
                               f"(plan hashes by pp rank: {[hex(h) for h in hashes]})")
        table = tracer.module_table(self.module)
        self._plan = [(name, plan.assignment[i], plan.node_cost[i])
                      for i, (name, _, _) in enumerate(table)]
        self._owner = {name: plan.assignment[i] for i, (name, _, _) in enumerate(table)}
        self._module_table = [(name, m) for name, m, _ in table]
        if core.rank() == 0:  # the same plan on every rank (hash checked): said once
            log.log_partition(self._module_table, self._owner, core.pp_size(),
                              lambda: plan.table(nodes), core.rank())
        engine = pipeline.Engine()
        self._tied = placement.apply(self._module_table, self._owner, engine, core.pp_rank())
        self._tied.sync_values()
        engine.order_gradients(self.module.parameters())
        self._engine = engine

    def _run_pipeline_step(self, fn, mb_inputs, sync_step, joining=None):
        self._in_step = True
        # Note [Pipeline overlap] (smp_core/detail/reducer_pipeline.cpp): the reducer of a
        # synchronized step is armed in C++ just before this rank's first gradient
        # accumulation (Note [Arming at the first backward], smp_core/dispatch.h), so each
        # bucket launches once its gradients are final, during the rest of the backward.
        reduce = sync_step and self._dp_reduce
        if reduce and self._reducer is None:
            self._make_reducer()  # every dp rank, at the same step
        dispatch = self._engine.dispatch
        if reduce:
            if self._pipeline_hold is None:  # the reducer's parameters never change
                self._pipeline_hold = [i for i, p in enumerate(self._reduced_params())
                                       if self._tied.holds(p)]
            dispatch.arm_reducer(self._reducer, self._pipeline_hold)
        try:
            self._tied.check_copies()  # Note [Tied copies] (placement.py)
            self._tied.begin_step()
            try:
                results, backward = self._engine.run_step(fn, mb_inputs)
            except BaseException as exc:
                self._tied.restore_grads()
                # Tell the other replicas rather than leave them waiting in their
                # reduction. Armed: this rank's backward work had begun.
                self._fail_reduction(sync_step, exc, dispatch.disarm())
                raise
            if backward:
                self._tied.sum_grads()
            else:
                self._tied.restore_grads()
            if backward and reduce:
                dispatch.arm_now()  # a rank that had no backward work of its own
                self._reducer.finalize()
            if joining is not None:
                joining.end_step(backward and sync_step and self._dp_reduce)
        finally:
            self._in_step = False
            dispatch.disarm()
        self._run_post_step_hooks()
        return results

    def _shutdown(self):
        """smp.shutdown(): stops the pipeline's threads and gives the module back its
        own classes (Note [Routing by class])."""
        if self._engine is not None:
            from smp import placement
            self._engine.shutdown()
            placement.restore_classes(self._module_table or ())
