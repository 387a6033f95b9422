"""`smp.DistributedModel`: the model wrapper (SMP v1 `smp.model.DistributedModel`).

Python here intercepts calls and presents the API; the gradient reduction (buckets,
hooks, ordering) is the C++ reducer (`smp._C.Reducer`), the partitioning is C++
(`smp._C.partition`).

Gradient averaging (explicit, see docs/data_parallel.md):
- over microbatches: with `average_grads_across_microbatches` each microbatch's
  backward is seeded with 1/microbatches (so a mean loss gives the full-batch mean
  gradient); otherwise gradients are summed over microbatches;
- over dp ranks: the comm hook averages (the default allreduce hook divides by the dp
  group size before the sum, as torch DDP does).
"""
import contextlib

import torch

from smp import activation_checkpointing, agreement, deferred_init, grad_guard, grad_norm
from smp import mixed_precision, optimizer_sharding, process_state, tp_substitution
from smp import join as _join
import smp._C as _C
from smp._C import ConfigError
from smp.ddp_comm_hooks._groups import resolve_hook_state
from smp.groups import get_dp_process_group
from smp.model_pipeline import PipelinePart
from smp.model_state import COMPILED, ModelStateMixin, canonical_key, former_keys
from smp.model_views import LocalViewsMixin
from smp.ranks import dp_size, pp_rank, pp_size, size, tp_size
from smp.replica import Replica

__all__ = []

_BOOL_ARGS = ("trace_execution_times", "overlapping_allreduce",
              "average_grads_across_microbatches", "trace_memory_usage", "broadcast_buffers",
              "gradient_as_bucket_view")


def _check_arg(name, value, ok, allowed):
    if not ok:
        raise ValueError(f"smp.DistributedModel: argument '{name}'={value!r} is not {allowed}")


_COMPILE_WATCH = []


def _check_offload(model):
    """Config offload_activations (SMP: checkpointed modules' activations kept in host
    memory): a CPU model keeps every activation in host memory already; moving a CUDA
    model's to the host is not built, so that is an error on every rank instead of a
    silent no-op."""
    if not getattr(process_state.state.cfg, "offload_activations", False):
        return
    devices = {p.device.type for p in model.module.parameters()}
    if "cuda" in devices:
        raise ConfigError("smp: config 'offload_activations'=true with a CUDA model is not "
                          "supported (allowed: false; on CPU, activations already stay in "
                          "host memory)")


def _watch_compile():
    """Note [Compiled names]: torch.compile(model) makes an OptimizedModule whose child
    `_orig_mod` is the model; its state_dict() is the model's, keys and all (the model
    drops the `_orig_mod.` prefix it is given), and its load_state_dict() takes the same
    keys: a load pre-hook puts them under `_orig_mod.` so they reach the model. Watched
    through torch's global module-registration hook (once per process; a registration
    of anything else costs one check)."""
    register = getattr(torch.nn.modules.module, "register_module_module_registration_hook",
                       None)
    if _COMPILE_WATCH or register is None:
        return

    def into_model(_module, state_dict, prefix, *_):
        inner = prefix + COMPILED + "."
        for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
            state_dict[inner + k[len(prefix):]] = state_dict.pop(k)

    def on_registration(parent, name, child):
        if name == COMPILED and isinstance(child, DistributedModel) and \
                type(parent).__name__ == "OptimizedModule":
            parent.register_load_state_dict_pre_hook(into_model)
    _COMPILE_WATCH.append(register(on_registration))


class DistributedModel(LocalViewsMixin, ModelStateMixin, torch.nn.Module, _join.Joinable):
    """Wraps `module` for model parallelism (partitions) and data parallelism (ddp).

    Composed of two parts: `replica` (smp/replica.py: the dp reduction, its comm hook
    and join state) and, once partitioned with partitions > 1, `pipeline`
    (smp/model_pipeline.py: the partition, the engine, the tied weights).

    Args:
        module: the model. Its Parameter objects are kept (an optimizer built on them
            before wrapping keeps working).
        trace_device: "cpu" or "gpu": where the first step traces the model.
        trace_execution_times: measure module times while tracing (partitioning input).
        overlapping_allreduce: start a bucket's communication as soon as it is ready
            (True) or all at the end of backward (False).
        backward_passes_per_step: steps whose gradients accumulate before one reduction.
        average_grads_across_microbatches: average (True) or sum gradients over
            microbatches.
        bucket_cap_mb: gradient bucket size in MiB.
        trace_memory_usage: measure module memory while tracing.
        broadcast_buffers: broadcast buffers from dp rank 0 before every step.
        gradient_as_bucket_view: gradients are views into the reduction buckets (saves a
            copy and memory).

    Raises:
        ValueError: a bad argument (named, with its value and what is allowed).
        RuntimeError: smp is not initialised, or a DistributedModel already exists.
    """

    def __init__(self, module, trace_device="cpu", trace_execution_times=False,
                 overlapping_allreduce=True, backward_passes_per_step=1,
                 average_grads_across_microbatches=True, bucket_cap_mb=25,
                 trace_memory_usage=False, broadcast_buffers=True,
                 gradient_as_bucket_view=False):
        super().__init__()
        process_state.require_init()
        _check_arg("module", module, isinstance(module, torch.nn.Module), "a torch.nn.Module")
        _check_arg("trace_device", trace_device, trace_device in ("cpu", "gpu"),
                   "one of {cpu, gpu}")
        if trace_device == "gpu" and not torch.cuda.is_available():
            trace_device = "cpu"
        _check_arg("backward_passes_per_step", backward_passes_per_step,
                   isinstance(backward_passes_per_step, int) and backward_passes_per_step >= 1,
                   "an integer >= 1")
        _check_arg("bucket_cap_mb", bucket_cap_mb,
                   isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0, "a number > 0")
        args = dict(trace_execution_times=trace_execution_times,
                    overlapping_allreduce=overlapping_allreduce,
                    average_grads_across_microbatches=average_grads_across_microbatches,
                    trace_memory_usage=trace_memory_usage, broadcast_buffers=broadcast_buffers,
                    gradient_as_bucket_view=gradient_as_bucket_view)
        for name in _BOOL_ARGS:
            _check_arg(name, args[name], isinstance(args[name], bool), "one of {True, False}")
        if process_state.state.model is not None:
            raise RuntimeError("smp: only one smp.DistributedModel may exist per process")
        cfg = process_state.state.cfg
        if dp_size() > 1 and not cfg.ddp:
            raise ConfigError(
                f"smp: config 'ddp'=false but the world holds {dp_size()} model replicas "
                f"(world {size()} / partitions {cfg.partitions}); set 'ddp': true so "
                "their gradients are reduced")
        # Note [Substitution] (smp/tp_substitution.py): the distributed modules replace
        # the tp-enabled registered ones before anything reads the model.
        module = tp_substitution.substitute(module)
        self._former_keys = former_keys(module)  # names saves of older smp used
        lazy = deferred_init.lazy_modules(module)
        if lazy:
            raise ValueError(f"smp.DistributedModel: modules {lazy} are torch lazy modules, "
                             "which create their parameters in forward; smp partitions by "
                             "the parameters a model has when it is wrapped. Run one "
                             "forward before wrapping, or give them their sizes")
        self.module = module
        # Note [Loaded as a child] (smp/model_state.py); torch < 1.13 has no post hooks
        post_hook = getattr(self, "register_load_state_dict_post_hook", None)
        self._hides_children = post_hook is not None
        if post_hook is not None:
            post_hook(self._children_back)
        _watch_compile()
        # Note [Replayed init] (smp/deferred_init.py): meta tensors until partitioned.
        self._deferred = deferred_init.is_deferred(module)
        mixed_precision.cast_module(module, later=deferred_init.is_recorded)
        self.trace_device = trace_device
        self.backward_passes_per_step = backward_passes_per_step
        self.bucket_cap_mb = float(bucket_cap_mb)
        for name in _BOOL_ARGS:
            setattr(self, name, args[name])
        self.partitioned = False
        self._post_partition_hooks = {}
        self._post_step_hooks = {}
        self._in_step_flag = False     # inside @smp.step (read and set as _in_step)
        self.pipeline = None        # PipelinePart (partitions > 1, after partitioning)
        self._plan = None
        self._owner = None          # module name -> pp rank (after partitioning)
        self._state_tensors = None  # the plain module's state, by key, in key order
        self._state_shapes = None   # their shapes (taken before other ranks' are released)
        self._pending_state = None  # load_state_dict before partitioning
        self._module_table = None   # (name, module) of the plain module, after partitioning
        self.replica = Replica(self.local_parameters, self.local_buffers, self.bucket_cap_mb,
                               gradient_as_bucket_view, overlapping_allreduce,
                               broadcast_buffers, backward_passes_per_step)
        _join.Joinable.__init__(self)  # Join: self._join_config (smp/join.py)
        self._grad_guard = None
        if not self._deferred:  # (a deferred model's parameters change tensors first)
            self._guard_gradients()
        process_state.state.model = self
        grad_norm.redirect_torch_clip()  # Note [torch's clip on the whole model]

    def _has_tp_slices(self):
        """Whether the model holds tensor-parallel slices (parameters marked
        `_smp_tp_dim`) under tensor_parallel_degree > 1."""
        return tp_size() > 1 and any(hasattr(p, "_smp_tp_dim") for p in self.module.parameters())

    def _guard_gradients(self):
        # Note [Unreduced gradients] (smp/grad_guard.py): loss.backward() under ddp, or
        # with partitions > 1 (where it would bypass the pipeline's backward), raises.
        if self.replica.reduces or pp_size() > 1:
            self._grad_guard = grad_guard.GradGuard(self.module.named_parameters())
            self._grad_guard.in_step = self._in_step_flag

    @property
    def _in_step(self):
        return self._in_step_flag

    @_in_step.setter
    def _in_step(self, value):
        # The gradient guard reads it in C++, from autograd's threads (smp/grad_guard.py).
        self._in_step_flag = value
        if self._grad_guard is not None:
            self._grad_guard.in_step = value

    # --- wrapper plumbing -------------------------------------------------------------

    def get_module(self):
        return self.module

    # Note [Plain names]
    # ~~~~~~~~~~~~~~~~~~
    # The model's parameters and buffers are named as in the plain module (SMP v1's
    # DistributedModel.named_parameters() is the wrapped module's), the names its
    # state_dict(), its optimizer's state and checkpoints use: no `module.` prefix of the
    # wrapper's own attribute, no `_orig_mod.` of torch.compile (Note [Compiled names]).
    # After partitioning they still name every parameter of the model; the ones other
    # pp ranks own have no elements here (local_named_parameters() gives this rank's).
    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        kw = {} if remove_duplicate else {"remove_duplicate": False}  # (torch 1.13: none)
        for name, p in self.module.named_parameters(prefix=prefix, recurse=recurse, **kw):
            yield canonical_key(name), p

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        kw = {} if remove_duplicate else {"remove_duplicate": False}
        for name, b in self.module.named_buffers(prefix=prefix, recurse=recurse, **kw):
            yield canonical_key(name), b

    def forward(self, *args, **kwargs):
        if not self._in_step and pp_size() > 1:
            raise RuntimeError("smp: a partitioned DistributedModel can only be called inside "
                               "an @smp.step function")
        args, kwargs = mixed_precision.cast_inputs(args, kwargs)
        return self.module(*args, **kwargs)

    # The parts' objects under the names tests and tools have used.
    @property
    def _reducer(self):
        return self.replica.reducer

    @property
    def _comm_hook(self):
        return self.replica.comm_hook

    @property
    def _steps(self):
        """Steps begun (the step policy's count, smp_core/replica_step.h)."""
        return self.replica.step.steps()

    @property
    def _engine(self):
        return self.pipeline.engine if self.pipeline is not None else None

    def _shutdown(self):
        """smp.shutdown(): unhooks the parameters (a later model may wrap the same
        module), then stops the pipeline's part."""
        if self._grad_guard is not None:
            self._grad_guard.remove()
            self._grad_guard = None
        if self.pipeline is not None:
            self.pipeline.shutdown()
        mixed_precision.reset()

    # --- the step ---------------------------------------------------------------------

    def _run_step(self, fn, mb_inputs, input_error=None):
        """Runs the step body once per microbatch; returns the per-microbatch results.

        `input_error`: the inputs could not be split (mb_inputs is None); the error is
        raised on every rank that shares the step (the first step's agreement, or the
        pipeline's abort), not only here.
        """
        if self._in_step:
            raise RuntimeError("smp: @smp.step functions cannot be nested")
        if pp_size() > 1:  # Join: pp peers follow their driver (smp/join.py)
            joining = _join.pipeline_begin_step(self)
            if joining is _join.SHADOWED:  # this replica has joined: a shadow iteration
                return [None] * process_state.state.cfg.microbatches
        else:
            joining = _join.begin_step(self)  # None outside an enabled Join
        if not self.partitioned:
            self._partition(fn, mb_inputs, input_error)
        elif input_error is not None:
            if pp_size() == 1 or pp_rank() == 0:
                # The dp peers are told through the step's own collectives (Note
                # [Failed rank] in smp_core/detail/reducer_shadow.cpp): they raise too,
                # naming this rank.
                self.replica.fail_step(self.replica.step.next_step_syncs(), input_error,
                                       armed=False)
            if pp_size() == 1:
                raise input_error
            if pp_rank() == 0:  # the driver tells every pp rank, then raises
                self.pipeline.engine.abort_step(input_error)
            # Other pp ranks do not use their inputs: they serve the driver's step.
        elif joining is None:
            self.replica.sync_before_forward()  # the buffers, when broadcast_buffers
        elif self.replica.broadcasts_buffers():
            joining.sync_buffers()  # Join's root instead of dp rank 0 (smp/join.py)
        step = self.replica.step
        sync_step = step.begin_step()  # every backward_passes_per_step-th synchronizes
        if joining is not None:
            sync_step = joining.announce(sync_step)
            step.set_sync_step(sync_step)
        if pp_size() > 1:
            self._in_step = True
            try:
                results = self.pipeline.run_step(fn, mb_inputs, sync_step, self.replica, joining)
            finally:
                self._in_step = False
            self._run_post_step_hooks()
            return results
        results = []
        self._in_step = True
        try:
            try:
                for mb, (args, kwargs) in enumerate(mb_inputs):
                    process_state.state.microbatch = mb
                    step.begin_microbatch(last=mb == len(mb_inputs) - 1)
                    if mb == 0:
                        self.replica.record_first_use(self.module)
                    results.append(fn(*args, **kwargs))
            except BaseException as e:
                if joining is None:  # (inside Join, its own protocol ends the step)
                    self.replica.fail_step(sync_step, e, armed=step.armed())
                raise
            self.replica.end_step()  # finalizes the reducer if the step armed it
            if joining is not None:
                joining.end_step(step.armed())
        finally:
            self._in_step = False
            self.replica.stop_recording()
        self._run_post_step_hooks()
        return results

    def first_step_without_batch(self):
        """Join (smp/join.py): a replica that has no batch at all still takes part in the
        first step's agreement and the broadcast of dp rank 0's state."""
        self._partition(None, None)

    def _partition(self, fn, mb_inputs, input_error=None):
        """First step: trace and partition (pp > 1), then sync the dp replicas."""
        if size() > 1:
            agreement.agree_on_first_step(self.module, input_error)
        elif input_error is not None:
            raise input_error
        # (materializing keeps each tensor's Python object: swap_tensors)
        self._state_tensors = self.module.state_dict(keep_vars=True)
        self._state_shapes = {k: tuple(v.shape) for k, v in self._state_tensors.items()}
        if self._deferred and pp_size() == 1:
            deferred_init.check_budget(self.module, process_state.state.optimizer, 1)
            deferred_init.materialize(self.module, dtype=mixed_precision.model_dtype())
        if pp_size() > 1:
            part = PipelinePart(self.module, fn, mb_inputs, self.trace_execution_times,
                                self.trace_memory_usage, self._stepping, self._deferred)
            self._plan, self._owner, self._module_table = part.plan, part.owner, part.module_table
            self.pipeline = part
        # Note [Half-precision model] (smp/mixed_precision.py): before the dp broadcast,
        # which then moves half the bytes.
        mixed_precision.cast_model(self)
        # Deferred to the first step, not wrap time (SMP semantics): parameters and
        # buffers from dp rank 0 (when the replica reduces).
        self.replica.sync_before_forward()
        if self._deferred:
            self._deferred = False
            self._guard_gradients()
            deferred_init.check_optimizer(process_state.state.optimizer)
        self.partitioned = True
        _check_offload(self)
        self.replica.shard = optimizer_sharding.divide(self)
        activation_checkpointing.after_partition(self)
        self._apply_pending_state()  # deferred model/optimizer loads (model_state.py)
        optimizer_sharding.install(self, process_state.state.optimizer)
        for hook in list(self._post_partition_hooks.values()):
            hook(self, process_state.state.optimizer)

    @contextlib.contextmanager
    def _stepping(self):
        """The model may be called (partitions > 1): inside a step, or while tracing."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def backward(self, tensors, grad_tensors=None):
        """Backward across partitions (replaces loss.backward() inside @smp.step).

        Args:
            tensors: a tensor or sequence of tensors (a scalar loss, typically).
            grad_tensors: gradients w.r.t. `tensors` (None for scalars).
        """
        if not self._in_step:
            raise RuntimeError("smp: model.backward() must be called inside an @smp.step "
                               "function")
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if grad_tensors is None:
            grad_tensors = [None] * len(tensors)
        elif isinstance(grad_tensors, torch.Tensor):
            grad_tensors = [grad_tensors]
        num_mb = process_state.state.cfg.microbatches
        if self.average_grads_across_microbatches and num_mb > 1:
            grad_tensors = [(torch.ones_like(t) if g is None else g) / num_mb
                            for t, g in zip(tensors, grad_tensors)]
        scale = mixed_precision.loss_scale()  # fp16 (Note [Half-precision model])
        if scale != 1.0:
            # As Megatron's `loss.float() * scale`: the scale reaches a half-precision
            # loss in its dtype (inf where it exceeds fp16's range: an overflow).
            grad_tensors = [(torch.ones_like(t, dtype=torch.float32) if g is None else g.float())
                            .mul(scale).to(t.dtype) for t, g in zip(tensors, grad_tensors)]
        if process_state.state.tracing:
            return  # the trace runs forward only
        if self.pipeline is not None:
            engine = self.pipeline.engine
            engine.forward_finished(process_state.state.microbatch_of_task())
            engine.wait_all_forwards()
            engine.backward_begins()
        elif self.replica.reduces:
            self.replica.prepare_for_backward(tensors)
        with self._grad_guard or contextlib.nullcontext():
            torch.autograd.backward(tensors, grad_tensors)

    # --- Join (uneven inputs; smp/join.py, docs/join.md) -------------------------------

    def join(self, divide_by_initial_world_size=True, enable=True,
             throw_on_early_termination=False):
        """`with model.join():` trains with uneven inputs across dp ranks (torch DDP's).

        A rank whose inputs ran out shadows its peers' steps until all ran out; then
        every rank takes the parameters and buffers of the last rank to finish.

        Args:
            divide_by_initial_world_size: average gradients over every dp rank (True)
                or over the ranks still training (False; default hook only).
            enable: False turns join off (even inputs).
            throw_on_early_termination: raise on every rank once any rank ran out.
        """
        return _join.Join([self], enable=enable,
                          throw_on_early_termination=throw_on_early_termination,
                          divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        return _join.model_join_hook(self, **kwargs)

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return get_dp_process_group()

    # --- hooks ------------------------------------------------------------------------

    def register_comm_hook(self, state, hook):
        """Registers a gradient communication hook (once, before the first step).

        Every rank calls it (the ranks agree on the groups). The hook reduces over the
        dp group: a state of None, or a state whose `process_group` is None, gets the dp
        group; a group with the dp group's members is replaced by smp's dp group; any
        other group raises (Note [Comm hooks reduce over the dp group] in
        smp/ddp_comm_hooks/_groups.py).

        Args:
            state: the hook's state (a process group, PowerSGDState, ... or None).
            hook: `hook(state, bucket) -> torch.futures.Future[Tensor]`, or a built-in
                from smp.ddp_comm_hooks (runs in C++).

        Raises:
            RuntimeError: called twice, or after the first step.
            ValueError: hook is not callable; smp.ConfigError (on every rank): the
                state names a group other than the dp group.
        """
        replica = self.replica
        if replica.comm_hook is not None or replica.reducer is not None or self._steps > 0:
            raise RuntimeError("smp: register_comm_hook must be called once, before the "
                               "first step")
        if not callable(hook):
            raise ValueError(f"smp: register_comm_hook hook={hook!r} is not callable")
        optimizer_sharding.check_hook(hook)
        name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or repr(hook)
        _C.Reducer.check_slices(self._has_tp_slices(), name)
        replica.comm_hook = (resolve_hook_state(state), hook)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clips gradients by the global norm over every partition (FSDP's name).

        Call it on every rank after the step, before the optimizer. Returns the norm,
        the same on every rank. See smp/grad_norm.py.
        """
        return grad_norm.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def cpu(self):
        """Gathers every pp rank's parameters and buffers and moves the model to CPU."""
        if self._owner is not None:
            full = self.state_dict()
            with torch.no_grad():
                for k, t in self._state_tensors.items():
                    if t.numel() == 0 and full[k].numel() > 0:
                        t.data = full[k].clone()
        self.module.cpu()
        return self
