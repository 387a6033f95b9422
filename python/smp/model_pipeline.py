"""The pipeline part of `smp.DistributedModel` (partitions > 1): the first step's trace
and partition, the pipeline engine and the tied weights, and each step run through the
engine with the tied-weight sum and the dp reduction overlapping the backward.

`DistributedModel` holds one `PipelinePart` (its `pipeline`, None before partitioning
and with partitions == 1) beside its `Replica` (smp/replica.py); the part gets what it
needs from the model as arguments and reads no attribute of the model.
"""
import contextlib

import torch

from smp import agreement, deferred_init, grad_guard, log, mixed_precision, pipeline
from smp import placement, remote_errors, tracer
from smp.collectives import allgather
from smp.groups import CommGroup
from smp.nested import leaves, map_leaves
from smp.process_state import state
from smp.ranks import pp_rank, pp_size, rank

__all__ = []


def trace(module, fn, mb_inputs, execution_times, memory_usage, stepping, deferred=False):
    """Runs the first microbatch through the whole model, recording the trace.

    `stepping()`: a context manager in which the model may be called (the step's).
    The trace leaves no trace: buffers (BatchNorm statistics, counters) and RNG
    states are restored afterwards, and it runs on a copy of the microbatch's
    tensors, so a module that changes its input in place does not change the
    user's batch before the step proper runs. A failure on any rank raises on
    every rank.

    `deferred`: the model's tensors are meta tensors (smp/deferred_init.py). A model
    built under smp.delay_param_initialization is traced on the real microbatch, its
    tensors materialized as they are used (Note [Traced on real values]); one built
    on the meta device without it runs on meta tensors, shapes only: the microbatch is
    moved to the meta device and so is every tensor the step creates.

    A failure names the module that was running and the last line of the model's
    code (not torch's or smp's) that ran.
    """
    recording = tracer.Trace(module, execution_times and not deferred, memory_usage)
    on_use = deferred and deferred_init.fully_recorded(module)
    on_meta = deferred and not on_use
    copy = (lambda t: t.to("meta")) if on_meta else torch.Tensor.clone
    args, kwargs = map_leaves(_drivers_microbatch(mb_inputs[0]), copy,
                              lambda x: isinstance(x, torch.Tensor))
    restore = agreement.snapshot_side_effects(module)
    state.tracing = True
    error = None
    before = deferred_init.state_tensors(module) if deferred else None
    values = (deferred_init.materialized_on_use(module, mixed_precision.model_dtype())
              if on_use else
              torch.device("meta") if on_meta else contextlib.nullcontext())
    try:
        with stepping(), recording, torch.no_grad(), _eager(), _backward_refused(), values:
            fn(*args, **kwargs)
        if deferred:
            deferred_init.check_nothing_created(module, before)
    except Exception as exc:  # reported to every rank below
        error = exc
        if not isinstance(exc, deferred_init.CreatedInForward):
            # (the same kind, so every rank raises it as such)
            error = remote_errors.restated(exc, f"{exc} ({recording.where_it_failed(exc)}" + (
                "; the first step traces a model built on the meta device on meta "
                "tensors, shapes only" if on_meta else "") + ")")
    finally:
        state.tracing = False
        restore()
    mine = recording.nodes() if error is None else None
    everyone = agreement.agree(error, CommGroup.WORLD,
                               agreement.first_error("tracing the model"), value=mine,
                               own_first=True)
    # pp rank 0's measurements decide (times differ between ranks).
    ref = everyone[state.topology.pp_group(rank())[0]]
    if [r["name"] for r in ref] != [r["name"] for r in mine]:
        raise RuntimeError(f"smp: the model differs between pp ranks: {len(mine)} modules "
                           f"on pp rank {pp_rank()}, {len(ref)} on pp rank 0")
    measured = ("activation_bytes", "time_ms", "mem_bytes", "first_call", "calls")
    return [dict(m, **{k: r[k] for k in measured}) for m, r in zip(mine, ref)]


def _drivers_microbatch(mine):
    """The first microbatch every pp rank traces: the driver's (pp rank 0's) tensors in
    place of this rank's. As in SMP v1.10 only the driver's inputs are used, so pp ranks
    other than 0 may pass placeholders (AWS's GPT-2 example gives them empty float
    tensors); tracing those would fail, or trace another path than the step takes. One
    allgather over the pp group (every pp rank is here: the first step's agreement
    passed); a rank whose tensors do not correspond one to one keeps its own."""
    is_tensor = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
    mine_t = leaves(mine, is_tensor)
    sent = [t.detach().cpu() for t in mine_t] if pp_rank() == 0 else None
    driver = allgather(sent, CommGroup.PP_GROUP)[0]
    if pp_rank() == 0 or len(driver) != len(mine_t):
        return mine
    it = iter(driver)
    return map_leaves(mine, lambda t: next(it).to(t.device), is_tensor)


@contextlib.contextmanager
def _backward_refused():
    """loss.backward() in the traced step raises smp's error, not autograd's (the trace
    runs under no_grad, where autograd says only that nothing requires grad)."""
    saved = torch.Tensor.backward, torch.autograd.backward
    torch.Tensor.backward = torch.autograd.backward = grad_guard.backward_in_trace
    try:
        yield
    finally:
        torch.Tensor.backward, torch.autograd.backward = saved


def _eager():
    """The trace runs the model eagerly: a module compiled before wrapping
    (torch.compile) is compiled by the steps that follow, not on the trace's hooks
    (whose timers and records Dynamo cannot compile)."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        return contextlib.nullcontext()
    return set_stance("force_eager")


class PipelinePart:
    """This rank's part of a partitioned model.

    Attributes (read-only for others):
        plan: [(module name, pp rank, normalized cost)] of the plain module's modules.
        owner: module name -> pp rank.
        module_table: [(name, module)] of the plain module, in pre-order.
        engine: the pipeline engine (smp/pipeline.py).
        tied: the parameters held on several pp ranks (placement.TiedParameters).
    """

    def __init__(self, module, fn, mb_inputs, execution_times, memory_usage, stepping,
                 deferred=False):
        """Traces and partitions `module` on the first step's first microbatch, then
        routes every module owned elsewhere and starts the engine (collective over the
        world; every rank or none raises). `deferred`: the model's tensors are meta
        tensors; each rank materializes what it keeps (smp/deferred_init.py)."""
        records = trace(module, fn, mb_inputs, execution_times, memory_usage, stepping,
                        deferred)
        nodes, plan = tracer.make_plan(records)
        hashes = allgather(plan.hash, CommGroup.MP_GROUP)
        if len(set(hashes)) != 1:
            raise RuntimeError("smp: ranks of the mp group computed different partitions "
                               f"(plan hashes by pp rank: {[hex(h) for h in hashes]})")
        table = tracer.module_table(module)
        self.plan = [(name, plan.assignment[i], plan.node_cost[i])
                     for i, (name, _, _) in enumerate(table)]
        self.owner = {name: plan.assignment[i] for i, (name, _, _) in enumerate(table)}
        self.module_table = [(name, m) for name, m, _ in table]
        if rank() == 0:  # the same plan on every rank (hash checked): said once
            log.log_partition(self.module_table, self.owner, pp_size(),
                              lambda: plan.table(nodes), rank())
        self.engine = pipeline.Engine()
        self.tied = placement.apply(self.module_table, self.owner, self.engine, pp_rank())
        if deferred:  # Note [Memory budget]: every rank says whether it fits, then allocates
            deferred_init.check_budget(module, state.optimizer, pp_size())
            deferred_init.materialize(module, dtype=mixed_precision.model_dtype())
        self.tied.sync_values()
        self.engine.order_gradients(module.parameters())
        self._hold = None  # reducer indices of tied parameters (held to finalize)

    def run_step(self, fn, mb_inputs, sync_step, replica, joining=None):
        """Runs one step through the pipeline; returns the per-microbatch results.

        `replica` (smp/replica.py) reduces the gradients of a synchronized step: its
        reducer is armed in C++ just before this rank's first gradient accumulation
        (Note [Arming at the first backward], smp_core/dispatch.h; Note [Pipeline
        overlap] in smp_core/detail/reducer_pipeline.cpp), so each bucket launches once
        its gradients are final, during the rest of the backward. `joining`: the step's
        join bookkeeping (smp/join.py), or None.
        """
        reduce = sync_step and replica.reduces
        reducer = replica.ensure_reducer() if reduce else None  # every dp rank, same step
        dispatch = self.engine.dispatch
        if reduce:
            if self._hold is None:  # the reducer's parameters never change
                self._hold = [i for i, p in enumerate(replica.params()) if self.tied.holds(p)]
            dispatch.arm_reducer(reducer, self._hold)
        try:
            self.tied.check_copies()  # Note [Tied copies] (placement.py)
            # Note [Step's finish] (smp_core/detail/step_end.cpp): as the step ends,
            # the dispatcher sums the tied gradients and finalizes the reducer, in C++.
            # With fp16 or a GradScaler, last: the step's overflow, agreed (Note [One
            # overflow decision] in smp_core/loss_scale.cpp).
            dispatch.finish_step_with(self.tied.begin_step(), reducer,
                                      mixed_precision.overflow_check(state.model))
            try:
                results, backward = self.engine.run_step(fn, mb_inputs)
            except BaseException as exc:
                if not dispatch.finish_began():  # the step's work failed, not its finish
                    self.tied.restore_grads()
                    # Tell the other replicas rather than leave them waiting in their
                    # reduction. Armed: this rank's backward work had begun.
                    replica.fail_step(sync_step, exc, dispatch.disarm())
                raise
            if joining is not None:
                joining.end_step(backward and sync_step and replica.reduces)
        finally:
            dispatch.disarm()
        return results

    def shutdown(self):
        """smp.shutdown(): stops the pipeline's threads and gives the module back its
        own classes (Note [Routing by class])."""
        self.engine.shutdown()
        placement.restore_classes(self.module_table)
