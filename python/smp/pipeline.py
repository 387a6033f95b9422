"""Pipelined execution across partitions (pp > 1).

Calling a module owned by another pp rank (routed by `smp.placement`) sends a
request (tensors by value, the rest pickled) through the C++
transport (`smp._C.P2PEngine`); the owner runs the module under autograd and answers
with the outputs. The call is one node of the caller's autograd graph, made in C++
(Note [Remote call node] in smp_core/remote_call.h): its backward sends the output
gradients to the owner and waits for the input gradients, which the owner computes on
the graph it recorded for that call, without entering Python on either side (Note
[Served backward] in smp_core/dispatch.h).

Tasks: the driver (pp rank 0) runs the step body once per microbatch, each on a C++
task thread (Note [Task threads] in smp_core/detail/task_pool.h); every other rank
serves all microbatches' requests with one leading thread.
Which thread runs what and when is decided in C++ (`smp._C.Dispatcher`,
smp_core/dispatch.h, Note [Serving]): the plan a training step executes (Note
[Executed plan]) or, in a step without one, the same rule applied as work becomes ready
(Note [Order without a list] in smp_core/plan.cpp): the receive order, the compute
token's turns, the driver's window and the hand-off of the lead when a request makes a
nested call. A task computes only while it holds the
rank's compute token, and gives it up while it waits for a message, so another
microbatch's work proceeds: that is the pipeline. Python runs what it is handed: a
module's forward (`_Modules.run`, for the C++ server: Note [Known forward requests]
in smp_core/serve.h), or one microbatch's step body (`Engine._drive`). A remote call
is made in C++ too (Note [Known calls] in smp_core/call.h); Python reads the subtree's
modes before it and pickles what is not a plain tensor (smp/remote_call.py).
Messages are matched by (microbatch, call id, kind), never by arrival order.

Failures: a module that raises on its owner is answered with an ERROR carrying the
exception and its traceback; the step body raises it on the driver, which then sends
ABORT to every pp rank, so every rank raises the same error and none hangs.
"""
import contextlib
import os
import pickle
import threading
import time

import torch
import torch.distributed as dist

import smp._C as _C
from smp import groups, log, placement, process_state
from smp.nested import TensorSlot, map_leaves, unflatten
from smp.ranks import pp_rank, pp_size, rank
from smp.remote_call import (flatten_args, flatten_outputs, unflatten_args,
                             unflatten_outputs)
from smp.remote_errors import RemoteTraceback, error_payload, raise_remote, remote_exception
from smp.task import current as _task
from smp.timeline import timeline

__all__ = []

K = _C.MsgKind
_CALL_ID_STRIDE = 1 << 40


def _encode_error(text):
    """The ERROR payload for a failure the C++ dispatcher met outside the handler."""
    return error_payload(RuntimeError(text))


def _travels(t):
    """A step output tensor that goes in the STEP_END message's tensors rather than
    pickled: a dense CPU one (what the mesh carries as it is)."""
    return t.layout == torch.strided and t.device.type == "cpu"


def _step_end_part(mb, out, backward):
    """Microbatch `mb`'s share of STEP_END (Note [Step end] in smp_core/dispatch.h):
    its outputs `out` as a message whose meta is the structure pickled and whose tensors
    are its dense CPU tensors, sent as they are (no torch pickling, which costs more than
    the send), with whether each required grad. `backward`: a backward had run in the
    step, in the call id (the combined STEP_END carries the OR: Note [Step's finish])."""
    tensors = []

    def slot(t):
        tensors.append(t.detach())
        return TensorSlot(len(tensors) - 1)
    skeleton = map_leaves(out, slot, lambda x: isinstance(x, torch.Tensor) and _travels(x))
    flags = [t.requires_grad for t in tensors]
    return _C.Message(mb, int(backward), K.STEP_END, pickle.dumps((skeleton, flags)), tensors)


def _decode_step_end(msg):
    """(per-microbatch outputs, whether a backward ran) from the driver's STEP_END."""
    results = []
    for part in _C.Dispatcher.step_end_parts(msg):
        skeleton, flags = pickle.loads(part.meta)
        tensors = [t.requires_grad_() if rg else t for t, rg in zip(part.tensors, flags)]
        results.append(unflatten(skeleton, tensors))
    return results, msg.call_id != 0


class _OwnErrors:
    """This step's exceptions raised here while serving, and the hooks the C++ server
    and dispatcher call with an error: the origin rank raises its own exception object
    again (Note [One traceback per error] in smp/remote_errors.py)."""

    def __init__(self):
        self.errors = []

    def clear(self):
        self.errors = []

    def own_error(self, exc):
        """The exception this rank raised while serving that `exc` (received back from
        the driver) is a copy of, or None."""
        for mine in self.errors:
            if type(mine) is type(exc) and str(mine) == str(exc):
                return mine
        return None

    def raise_answer(self, meta):
        """Raises the exception an ERROR answer or the step's ABORT carries (the C++
        caller and a remote call's C++ backward: Dispatcher.raise_answer)."""
        raise_remote(meta, self.own_error)

    def request_failed(self, exc, mb, backward):
        """Note [Known forward requests] in smp_core/serve.h: the ERROR answer's
        payload for a request of microbatch `mb` that raised `exc` (`backward`: a
        backward request)."""
        return self._failed(exc, (pp_rank(), mb, backward))

    def backward_failed(self, exc, mb, weight):
        """Note [Served backward]: the ERROR answer's payload for a call of microbatch
        `mb` whose backward, served in C++, raised `exc` (`weight`: in its W, under
        zero_bubble; the cell then says so, for the plan's marking)."""
        return self._failed(exc, (pp_rank(), mb, True) + ((True,) if weight else ()))

    def _failed(self, exc, cell):
        if getattr(exc, "_smp_cell", None) is None:
            try:
                exc._smp_cell = cell
            except AttributeError:
                pass
        self.errors.append(exc)  # See Note [One traceback per error]
        return error_payload(exc)


class _Modules:
    """What only Python can do to serve a request (Note [Known forward requests] in
    smp_core/serve.h): run an owned module in its subtree's train/eval modes, with the
    thread's microbatch set for the module's nested calls, from and to the structures
    smp/remote_call.py pickles. Holds the modules, not the engine."""

    def __init__(self, owned, subtrees):
        self.owned = owned        # module name -> module (served here)
        self.subtrees = subtrees  # module name -> its subtree's modules (mode flags)
        # Seconds in the served modules' own forward (the backward's is the dispatcher's:
        # Engine.compute_s; the rest of the compute-token time is smp's per-request
        # overhead; bench/pipeline.py).
        self.forward_s = 0.0

    def run(self, name, mb, flags, args, skeleton):
        """Runs module `name` for microbatch `mb` (C++ sets the grad mode): first in
        mode `flags` unless None (a request known this step), on the tensors `args`,
        positionally or as pickled `skeleton` places them. Returns (the output as
        remote_call.flatten_outputs gives it, whether a module's mode switched)."""
        changed = False
        if flags is not None:
            subtree = self.subtrees[name]
            changed = placement.mode_flags(subtree) != flags
            if changed:
                placement.apply_mode_flags(subtree, flags)
        kwargs = {}
        if skeleton is not None:
            args, kwargs = unflatten_args(skeleton, args)
        prev = _task.mb, _task.backward
        _task.mb, _task.backward = mb, False
        try:
            if timeline.enabled or Engine.task_context is not None:
                with timeline.span(f"fwd {name}", mb=mb), Engine._task_context():
                    out = self._forward(name, args, kwargs)
            else:
                out = self._forward(name, args, kwargs)
        finally:
            _task.mb, _task.backward = prev
        return flatten_outputs(out), changed

    def _forward(self, name, args, kwargs):
        t = time.perf_counter()
        try:
            return self.owned[name](*args, **kwargs)
        finally:
            self.forward_s += time.perf_counter() - t


class Engine:
    """Per-process pipeline state: transport, owned modules, recorded calls."""

    # Instrumentation (benchmarks): a factory of a context manager entered by every
    # task thread around its work, e.g. to install saved-tensor hooks per thread.
    task_context = None
    _created = 0

    def __init__(self):
        self._backward_ran = False  # the driver: some microbatch's backward ran this step
        self.cfg = process_state.state.cfg
        Engine._created += 1  # every rank creates its engines in the same order
        pp_ranks = process_state.state.topology.pp_group(rank())
        self.p2p = _C.P2PEngine(process_state.state.store,
                                f"smp/p2p/{pp_ranks[0]}/{Engine._created}",
                                pp_rank(), pp_size(), self.cfg.timeout_s,
                                os.environ.get("MASTER_ADDR", "127.0.0.1"))
        self._set_payload_transport(pp_ranks)
        self.owned = {}        # module name -> module (served here)
        self.subtrees = {}     # module name -> its subtree's modules (mode flags)
        self.errors = _OwnErrors()
        self.modules = _Modules(self.owned, self.subtrees)
        self.lock = threading.Lock()
        self.epoch = 0
        # Note [Task threads] (smp_core/detail/task_pool.h): persistent C++ threads,
        # each with a Python thread state of its own, entering Python only to serve a
        # request or run a step body.
        self.threads = _C.TaskPool("smp-task")
        # Note [Known forward requests] (smp_core/serve.h): every request this rank
        # serves runs through one C++ function, which enters Python only to run the
        # module.
        self.known = _C.Server(self.modules.run, self.errors.request_failed, pp_rank())
        # The one source of order: the C++ dispatcher executes the step's plan, or orders
        # a step without one by the rule plans are compiled by (token turns, receive
        # order, the driver's window, the "simple" barrier), and hands this engine the
        # work to run.
        self.dispatch = _C.Dispatcher(self.p2p, self.cfg.pipeline, self.cfg.microbatches,
                                      pp_size(), self.cfg.active_microbatches, self.known,
                                      self.threads, _encode_error, self.errors.raise_answer)
        # Note [Served backward] (smp_core/dispatch.h): a served forward that recorded a
        # graph leaves its inputs and outputs to the dispatcher, which serves the call's
        # backward in C++; a failure there comes back here to be answered.
        self.dispatch.set_failure_encoder(self.errors.backward_failed)
        # Note [Known calls] (smp_core/call.h): every call of a module another pp rank
        # owns is made by one C++ function (Engine.call).
        self.calls = _C.Caller(self.dispatch, pp_rank() * _CALL_ID_STRIDE, flatten_args,
                               unflatten_outputs)
        self.dispatch.record_spans(timeline.enabled)
        self._forwards_first = self.dispatch.forwards_before_backwards()
        self._planned = self.cfg.pipeline_order == "planned"
        self._new_plans = 0       # the driver's, at its last step (_log_new_plan)
        self._plan_logged = None
        self._fallbacks = 0       # Stats::plan_fallbacks at the last step (_log_departure)
        self._planned_seen = 0    # Stats::planned_steps after the last step (_log_departure)

    def _set_payload_transport(self, pp_ranks):
        """Note [Payload transports] in smp_core/p2p.h: with config 'p2p_transport'
        'c10d' (or 'auto' where CUDA is available) tensors travel by c10d send/recv on a
        group of the pp ranks of their own (Gloo for CPU, NCCL for CUDA tensors)."""
        mode = self.cfg.p2p_transport
        cuda = torch.cuda.is_available()
        if mode == "tcp" or (mode == "auto" and not cuda):
            return
        backend = groups.choose_backend("nccl") if cuda and dist.is_nccl_available() else "gloo"
        mine = groups.new_groups_within_pp_groups(range(len(pp_ranks)), backend=backend)
        device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
        kind = _C.PayloadTransport.C10D if mode == "c10d" else _C.PayloadTransport.AUTO
        self.p2p.set_payload_group(mine, kind, device)

    @property
    def compute_s(self):
        """Seconds spent in served modules' own forward and backward on this rank."""
        return self.modules.forward_s + self.dispatch.stats().backward_s

    def order_gradients(self, params):
        """Note [Gradient order] (smp_core/dispatch.h): `params`, the parameters this
        rank holds, sum their microbatches' gradients in microbatch order."""
        self.dispatch.order_gradients([p for p in params if p.requires_grad and p.numel() > 0])

    def log_failure(self, exc):
        """Every rank logs the step x rank table with the failing cell marked."""
        cell = getattr(exc, "_smp_cell", None)
        try:
            # The plan the step executed, its failing action marked (Note [Executed plan]),
            # or, in a step without one, what this rank ran (Note [Order without a list]):
            # the lists that ran, not a model of them.
            table = self.dispatch.plan_text(tuple(cell) if cell else None)
            if table.startswith("plan "):
                table = "executed " + table
        except Exception as e:  # the table must never hide the error itself
            table = f"(no schedule table: {e})\n"
        phase = "forward" if not cell or not cell[2] else (
            "backward (its weight-gradient half, W)" if len(cell) > 3 and cell[3] else "backward")
        where = f"pp rank {cell[0]}, microbatch {cell[1]}, {phase}" if cell else "an unknown cell"
        # logger.error, not a print: with no logging configured smp's handler puts it on
        # stderr as before; a job that sends its logs elsewhere (files, a collector)
        # finds the table there, beside smp's other records. See python/smp/log.py.
        log.get_logger("pipeline").error("smp: step %d failed at %s (rank %d): %s: %s\n%s",
                                         self.epoch, where, rank(), type(exc).__name__,
                                         exc, table.rstrip("\n"))

    # --- caller side ------------------------------------------------------------------

    def call(self, name, owner, args, kwargs):
        """Runs module `name` on pp rank `owner` for the calling task's microbatch:
        placement routes every remote module's call here. C++ makes the call (Note
        [Making a remote call] in smp_core/call.h) with the subtree's train/eval flags
        (Note [Mode travels with the call] in smp/placement.py)."""
        flags = placement.mode_flags(self.subtrees[name])
        if not timeline.enabled:
            return self.calls(name, owner, args, kwargs, flags)
        with timeline.span(f"call {name}", mb=_task.mb):
            return self.calls(name, owner, args, kwargs, flags)

    # --- the step ---------------------------------------------------------------------

    @staticmethod
    def _task_context():
        return Engine.task_context() if Engine.task_context else contextlib.nullcontext()

    def run_step(self, fn, mb_inputs):
        """Runs one step; returns (per-microbatch results, whether backward ran) on
        every pp rank (the driver sends both with STEP_END)."""
        # Note [Known forward requests] (smp_core/serve.h): modes may have changed
        # between steps.
        self.known.begin_step()
        self.calls.begin_step()
        self.errors.clear()
        self._backward_ran = False
        self._open_epoch()
        timeline.begin_step()  # SMP_TIMELINE_STEPS counts the pipelined steps
        # Deterministic: a microbatch's random numbers do not depend on timing, the
        # schedule or the partitioning (Note [Microbatch random streams] in
        # smp_core/task_rng.h), and gradients sum in microbatch order (Note [Gradient
        # order] in smp_core/dispatch.h): the same job twice gives the same numbers.
        cuda_rng = torch.cuda.is_available() and torch.cuda.is_initialized()
        # With config 'pipeline_order' "planned", a step that trains executes the plan
        # of the calls the last one made (Note [Executed plan] in
        # smp_core/detail/plan_execution.cpp); evaluation runs without a list (Note
        # [Order without a list] in smp_core/plan.cpp).
        self.dispatch.begin_step(len(mb_inputs) if pp_rank() == 0 else self.cfg.microbatches,
                                 deterministic=True, rng_cuda=cuda_rng,
                                 planned=self._planned and torch.is_grad_enabled())
        if pp_rank() != 0:
            try:
                return self._serve_step()
            finally:
                self._log_departure(self.dispatch.stats())
        out = self._drive(fn, mb_inputs)
        self._log_new_plan()
        return out

    def _open_epoch(self):
        """The next step-level exchange (a step, an abort, a join state) in an epoch of
        its own, the same sequence on every pp rank (Note [Step epochs] in
        smp_core/p2p.h)."""
        self.epoch += 1
        self.p2p.begin_step(self.epoch)

    def _log_departure(self, stats):
        """Note [Leaving the plan] (smp_core/detail/plan_execution.cpp): a step that left
        its plan says why, on the rank that saw it. Each step's lists go in the timeline:
        this rank's planned actions (none in a step without a plan: Note [Order without
        a list] in smp_core/plan.cpp) and those it ran, the strings the plan's log and
        failure table print."""
        planned = stats.planned_steps > self._planned_seen
        self._planned_seen = stats.planned_steps
        if timeline.enabled and timeline.recording:
            now = time.perf_counter()
            timeline.event("plan", now, now,
                           planned=self.dispatch.planned_actions() if planned else [],
                           executed=self.dispatch.executed_actions())
        if stats.plan_fallbacks == self._fallbacks:
            return
        self._fallbacks = stats.plan_fallbacks
        why = self.dispatch.plan_departure()
        if why:
            log.log_plan_departure(self.epoch, why, rank())

    def _log_new_plan(self):
        """The driver says once which plan its steps execute, and again when it changes.
        Formatting a plan costs ~0.5 ms and runs between steps, on the step's path: only
        a plan unlike the last one (Dispatcher::Stats::new_plans) is formatted."""
        stats = self.dispatch.stats()
        self._log_departure(stats)
        new = stats.new_plans
        if new == self._new_plans:
            return
        self._new_plans = new
        text = self.dispatch.plan_text()
        if text != self._plan_logged:
            self._plan_logged = text
            log.log_plan(text, rank())

    def abort_step(self, exc):
        """On the driver: this step cannot start (a bad input). Every pp rank, serving
        the step, raises `exc`'s message; so does the driver."""
        self._open_epoch()
        timeline.begin_step()  # the owners count this step in run_step
        self.dispatch.tell_pp_ranks(_C.Message(-1, 0, K.ABORT, error_payload(exc)))
        raise exc

    def _drive(self, fn, mb_inputs):
        """The driver: the dispatcher runs `run` for each microbatch, in order, at most
        the driver's window at once, with the token held; each returns its share of
        the step's end (its outputs, or its error), which the dispatcher sends on (Note
        [Step end] in smp_core/dispatch.h)."""
        results, errors = [None] * len(mb_inputs), []

        def run(mb):
            _task.mb, _task.backward = mb, False  # per thread: no shared "current microbatch"
            try:
                with timeline.span("microbatch", mb=mb), self._task_context():
                    results[mb] = fn(*mb_inputs[mb][0], **mb_inputs[mb][1])
                # An output that cannot be sent fails the step on every rank, here.
                return _step_end_part(mb, results[mb], self._backward_ran)
            except BaseException as exc:
                with self.lock:
                    first = not errors
                    errors.append(exc)
                if not first:  # the step is failing already: the first error is the one sent
                    return _C.Message(mb, 0, K.ABORT)
                if getattr(exc, "_smp_cell", None) is None:
                    try:
                        exc._smp_cell = (0, mb, bool(_task.backward))
                    except AttributeError:
                        pass
                return _C.Message(mb, 0, K.ABORT, error_payload(exc))
            finally:
                _task.mb = None

        try:
            self.dispatch.drive_step(run)
        except BaseException as exc:
            # Raised at the step's end (a serving rank's W failed: Note [Zero bubble at
            # run time]); the dispatcher has aborted the step on every pp rank.
            self.log_failure(exc)
            raise
        finally:
            self._timeline_spans()
        if errors:
            self.log_failure(errors[0])
            raise errors[0]
        return results, self._backward_ran

    # Note [Join with pipeline parallelism] (smp/join.py): each iteration's join state
    # goes from the driver to its pp peers in an epoch of its own.
    def send_join_state(self, state):
        """Driver: opens an epoch for this iteration's join state and sends it."""
        self._open_epoch()
        self.dispatch.tell_pp_ranks(_C.Message(-1, 0, K.STEP_END, pickle.dumps(("smp-join", state))))

    def receive_join_state(self):
        """Peer: the driver's join state of this iteration (its ABORT raises)."""
        self._open_epoch()
        msg = self.p2p.recv(-1, _C.ANY, (1 << int(K.STEP_END)) | (1 << int(K.ABORT)),
                            "this iteration's join state from the pipeline driver (pp rank 0)")
        if msg.kind == K.ABORT:
            raise_remote(msg.meta)
        tag, state = pickle.loads(msg.meta)
        if tag != "smp-join":
            raise RuntimeError("smp.join: pipeline protocol error: expected the join state "
                               f"from pp rank 0, got {tag!r}")
        return state

    def _timeline_spans(self):
        """The backward spans of the calls served in C++ (Note [Served backward])."""
        for mb, start, end in self.dispatch.take_spans():
            timeline.event("bwd", start, end, mb)

    def _serve_step(self):
        try:
            msg = self.dispatch.serve_step()
        finally:
            self._timeline_spans()
        if msg.kind == K.ABORT:
            exc, text, origin = remote_exception(msg.meta)
            self.log_failure(exc)
            mine = self.errors.own_error(exc) if origin == rank() else None
            if mine is not None:
                raise mine  # See Note [One traceback per error]
            raise exc from RemoteTraceback(text)
        return _decode_step_end(msg)

    # "simple": every microbatch's forward finishes before any backward starts (C++).
    # Under the other schedules both are no-ops: not crossing into C++ for them saves
    # two of a driver's crossings per microbatch (Dispatcher::Stats::crossings).
    def forward_finished(self, mb):
        if self._forwards_first:
            self.dispatch.forward_finished(mb)

    def wait_all_forwards(self):
        if self._forwards_first:
            self.dispatch.wait_all_forwards(_task.mb)

    def backward_begins(self):
        """The driver: a microbatch's step body calls model.backward (any task thread)."""
        self._backward_ran = True

    def shutdown(self):
        self.threads.stop()
        self.dispatch = None  # it holds this engine's handler: break the cycle
        self.calls.close()  # it holds the dispatcher
        self.known = None  # its hooks hold the modules
        self.p2p = None
