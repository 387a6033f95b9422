"""Pipelined execution across partitions (pp > 1).

Calling a module owned by another pp rank (routed by `smp.placement`) sends a
request (tensors by value, the rest pickled) through the C++
transport (`smp._C.P2PEngine`); the owner runs the module under autograd and answers
with the outputs. `_RemoteCall` makes the call one node of the caller's autograd
graph: its backward sends the output gradients to the owner and waits for the input
gradients, which the owner computes on the graph it recorded for that call.

Tasks: the driver (pp rank 0) runs the step body once per microbatch, each in a
thread; every other rank serves all microbatches' requests with one leading thread
(Note [Serving]). A task computes only
while it holds the rank's compute token (C++), and gives it up while it waits for a
message, so another microbatch's work proceeds: that is the pipeline. Token priorities
encode the schedule (see `_priority`). Messages are matched by (microbatch, call id,
kind), never by arrival order.

Failures: a module that raises on its owner is answered with an ERROR carrying the
exception and its traceback; the step body raises it on the driver, which then sends
ABORT to every pp rank, so every rank raises the same error and none hangs.
"""
import contextlib
import datetime
import os
import pickle
import sys
import threading

import torch
import torch.distributed as dist

from smp import _C, core, placement
from smp.nested import flatten, unflatten
from smp.remote_call import Call, RemoteCall, anchor
from smp.remote_errors import RemoteTraceback, error_payload, raise_remote, remote_exception
from smp.task import current as _task
from smp.workers import Workers
from smp.timeline import timeline

__all__ = []

K = _C.MsgKind
_BIT = {k: 1 << int(k) for k in (K.REQUEST, K.RESPONSE, K.BACKWARD_REQUEST,
                                 K.BACKWARD_RESPONSE, K.ERROR, K.STEP_END, K.ABORT)}
_SERVE_MASK = _BIT[K.REQUEST] | _BIT[K.BACKWARD_REQUEST] | _BIT[K.ABORT]
_CALL_ID_STRIDE = 1 << 40


class _ServingState:
    def __init__(self):
        self.cond = threading.Condition()
        self.free = True   # nobody leads: the next idle worker takes the lead
        self.over = False  # the step ended (or failed)
        self.idle = 0      # workers waiting to lead
        self.errors = []

    def end(self):
        with self.cond:
            self.over = True
            self.cond.notify_all()


class Engine:
    """Per-process pipeline state: transport, owned modules, recorded calls."""

    # Instrumentation (benchmarks): a factory of a context manager entered by every
    # task thread around its work, e.g. to install saved-tensor hooks per thread.
    task_context = None
    _created = 0

    def __init__(self, model):
        self.model = model
        self.cfg = core.state.cfg
        Engine._created += 1  # every rank creates its engines in the same order
        pp_ranks = core.state.topology.pp_group(core.rank())
        self.p2p = _C.P2PEngine(core.state.store, f"smp/p2p/{pp_ranks[0]}/{Engine._created}",
                                core.pp_rank(), core.pp_size(), self.cfg.timeout_s,
                                os.environ.get("MASTER_ADDR", "127.0.0.1"))
        self._set_payload_transport(pp_ranks)
        self.owned = {}        # module name -> module (served here)
        self.subtrees = {}     # module name -> its subtree's modules (mode flags)
        self.records = {}      # (caller, mb, call id) -> (input leaves, outputs)
        self.counters = {}     # mb -> next call id
        self.lock = threading.Lock()
        self.num_mb = self.cfg.microbatches
        self.epoch = 0
        self.fwd_done = set()  # microbatches whose forward finished ("simple")
        self.fwd_cond = threading.Condition()
        self.workers = Workers("smp-task")
        # The one source of order: token priorities, receive order, the driver's window
        # and the "simple" barrier all come from the C++ schedule (smp_core/scheduler.h).
        self.schedule = _C.Schedule(self.cfg.pipeline, self.cfg.microbatches, core.pp_size(),
                                    self.cfg.active_microbatches)
        self._order = self.schedule.recv_order()
        self._serving = None

    def _set_payload_transport(self, pp_ranks):
        """Note [Payload transports] in smp_core/p2p.h: with config 'p2p_transport'
        'c10d' (or 'auto' where CUDA is available) tensors travel by c10d send/recv on a
        group of the pp ranks of their own (Gloo for CPU, NCCL for CUDA tensors)."""
        mode = self.cfg.p2p_transport
        cuda = torch.cuda.is_available()
        if mode == "tcp" or (mode == "auto" and not cuda):
            return
        backend = core._choose_backend("nccl") if cuda and dist.is_nccl_available() else "gloo"
        timeout = datetime.timedelta(seconds=self.cfg.timeout_s)
        mine = None
        for ranks in core.state.topology.all_pp_groups():  # every rank, the same order
            group = dist.new_group(list(ranks), timeout=timeout, backend=backend)
            if list(ranks) == list(pp_ranks):
                mine = group
        device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
        kind = _C.PayloadTransport.C10D if mode == "c10d" else _C.PayloadTransport.AUTO
        self.p2p.set_payload_group(mine, kind, device)

    def _priority(self, mb, backward):
        return self.schedule.priority(mb, backward)

    def log_failure(self, exc):
        """Every rank logs the step x rank table with the failing cell marked."""
        cell = getattr(exc, "_smp_cell", None)
        try:
            table = self.schedule.grid([], tuple(cell) if cell else None)
        except Exception as e:  # the table must never hide the error itself
            table = f"(no schedule table: {e})\n"
        where = (f"pp rank {cell[0]}, microbatch {cell[1]}, "
                 f"{'backward' if cell[2] else 'forward'}") if cell else "an unknown cell"
        print(f"smp: step {self.epoch} failed at {where} (rank {core.rank()}): "
              f"{type(exc).__name__}: {exc}\n{table}", file=sys.stderr, end="", flush=True)

    def _next_call_id(self, mb):
        with self.lock:
            n = self.counters.get(mb, 0)
            self.counters[mb] = n + 1
        return core.pp_rank() * _CALL_ID_STRIDE + n

    # --- caller side ------------------------------------------------------------------

    def wait(self, mb, call_id, kind, what):
        """Waits for the answer to `call_id`, serving requests of `mb` meanwhile."""
        self._resign()
        mask = _BIT[kind] | _BIT[K.ERROR] | _SERVE_MASK
        while True:
            msg = self.p2p.recv(mb, _C.ANY, mask, what, True,
                                self._priority(mb, _task.backward))
            if msg.kind in (K.REQUEST, K.BACKWARD_REQUEST):
                self.serve(msg)
                continue
            if msg.kind == K.ABORT:
                raise_remote(msg.meta)
            if msg.call_id != call_id:
                raise RuntimeError(f"smp: pipeline protocol error: got {K(msg.kind).name} of "
                                   f"call {msg.call_id} while waiting for call {call_id}")
            if msg.kind == K.ERROR:
                raise_remote(msg.meta)
            return msg

    def call(self, name, owner, args, kwargs):
        """Runs module `name` on pp rank `owner` for the current microbatch."""
        mb = _task.mb
        if mb is None:
            raise RuntimeError(f"smp: module '{name}' lives on pp rank {owner}; call the "
                               "model inside an @smp.step function")
        tensors = []
        skeleton = flatten((args, kwargs), tensors)
        grad = torch.is_grad_enabled()
        flags = placement.mode_flags(self.subtrees[name])
        call = Call(self, name, owner, mb, self._next_call_id(mb), skeleton, tensors, grad,
                     flags)
        if grad:
            outs = RemoteCall.apply(call, anchor(), *tensors)
            if not isinstance(outs, tuple):
                outs = (outs,)
        else:
            outs = call.forward(tensors)
        return unflatten(call.out_skeleton, list(outs))

    # --- owner side -------------------------------------------------------------------

    def serve(self, msg):
        """Runs one request on this rank (forward or backward of a recorded call)."""
        key = (msg.src, msg.mb, msg.call_id)
        try:
            if msg.kind == K.REQUEST:
                name, skeleton, requires_grad, grad, flags = pickle.loads(msg.meta)
                placement.apply_mode_flags(self.subtrees[name], flags)
                with timeline.span(f"fwd {name}", mb=msg.mb):
                    inputs = [t.requires_grad_() if rg and grad else t
                              for t, rg in zip(msg.tensors, requires_grad)]
                    args, kwargs = unflatten(skeleton, inputs)
                    prev, _task.backward = _task.backward, False
                    try:
                        with torch.set_grad_enabled(grad):
                            out = self.owned[name](*args, **kwargs)
                    finally:
                        _task.backward = prev
                    outs = []
                    out_skeleton = flatten(out, outs)
                    if grad:
                        self.records[key] = (inputs, outs)
                    meta = pickle.dumps((out_skeleton, [t.requires_grad for t in outs]))
                    self.p2p.send(msg.src, _C.Message(msg.mb, msg.call_id, K.RESPONSE, meta,
                                                      [t.detach() for t in outs]))
            else:
                present = pickle.loads(msg.meta)
                inputs, outs = self.records.pop(key)
                self.model.begin_pipeline_backward()
                grads = iter(msg.tensors)
                pairs = [(o, next(grads)) for o, p in zip(outs, present) if p]
                with timeline.span("bwd", mb=msg.mb):
                    prev, _task.backward = _task.backward, True
                    try:
                        if pairs:
                            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                    finally:
                        _task.backward = prev
                    in_grads = [t.grad if t.requires_grad else None for t in inputs]
                    meta = pickle.dumps([g is not None for g in in_grads])
                    self.p2p.send(msg.src, _C.Message(
                        msg.mb, msg.call_id, K.BACKWARD_RESPONSE, meta,
                        [g for g in in_grads if g is not None]))
        except Exception as exc:  # answer the caller; it re-raises with our traceback
            self.records.pop(key, None)
            self.p2p.send(msg.src, _C.Message(msg.mb, msg.call_id, K.ERROR,
                                              error_payload(exc), []))

    # Note [Serving]: a non-driver rank serves requests of every microbatch with ONE
    # thread at a time, the leader: it takes the next request (backward work first under
    # "interleaved") and runs it. Running every microbatch on its own thread instead
    # costs a thread switch per request and cold per-thread state (measured ~0.3 ms a
    # request here). Only when the request being served makes a nested remote call and
    # must wait does the leader hand the lead to an idle worker (`_resign`), so other
    # microbatches keep being served while it waits; it serves requests of its own
    # microbatch meanwhile, like every waiting task.
    def _serve_worker(self):
        st = self._serving
        try:
            while True:
                with st.cond:  # bounded: the leader's waits end the step on a timeout
                    st.idle += 1
                    st.cond.wait_for(lambda: st.free or st.over)
                    st.idle -= 1
                    if st.over:
                        return
                    st.free = False
                _task.leader = True
                while _task.leader:
                    msg = self.p2p.recv(_C.ANY, _C.ANY, _SERVE_MASK | _BIT[K.STEP_END],
                                        "work from the pipeline driver (pp rank 0)",
                                        order=self._order)
                    if msg.kind in (K.STEP_END, K.ABORT):  # an abort is raised by the main thread
                        st.end()
                        return
                    backward = msg.kind == K.BACKWARD_REQUEST
                    self.p2p.acquire_token(self._priority(msg.mb, backward))
                    try:
                        _task.mb, _task.backward = msg.mb, backward
                        with self._task_context():
                            self.serve(msg)
                    finally:
                        self.p2p.release_token()
                        _task.mb = None
        except Exception as exc:
            st.errors.append(exc)
            st.end()
        finally:
            _task.leader = False

    def _resign(self):
        """Called by a serving leader about to wait: another worker takes the lead."""
        if not _task.leader:
            return
        _task.leader = False
        st = self._serving
        with st.cond:
            st.free = True
            st.cond.notify()
            if st.idle == 0:  # every worker waits on a nested call: add one
                self.workers.spawn(self._serve_worker)

    # --- the step ---------------------------------------------------------------------

    def _task_context(self):
        return Engine.task_context() if Engine.task_context else contextlib.nullcontext()

    def run_step(self, fn, mb_inputs):
        """Runs one step; returns (per-microbatch results, whether backward ran) on
        every pp rank (the driver sends both with STEP_END)."""
        self.counters.clear()
        self.fwd_done = set()
        self.num_mb = self.cfg.microbatches
        self.epoch += 1
        self.p2p.begin_step(self.epoch)  # Note [Step epochs] in smp_core/p2p.h
        if core.pp_rank() == 0:
            return self._drive(fn, mb_inputs)
        return self._serve_step()

    def abort_step(self, exc):
        """On the driver: this step cannot start (a bad input). Every pp rank, serving
        the step, raises `exc`'s message; so does the driver."""
        self.epoch += 1
        self.p2p.begin_step(self.epoch)
        payload = error_payload(exc)
        for r in range(1, core.pp_size()):
            self.p2p.send(r, _C.Message(-1, 0, K.ABORT, payload, []))
        raise exc

    def _drive(self, fn, mb_inputs):
        num_mb = len(mb_inputs)
        results, errors = [None] * num_mb, []
        active = self.schedule.window()
        order = iter(range(num_mb))  # next() of a range iterator is atomic under the GIL

        def worker():  # at most `active` microbatches in flight, started in order
            for mb in order:
                run(mb)

        def run(mb):
            _task.mb, _task.backward = mb, False
            self.model._set_microbatch(mb)
            self.p2p.acquire_token(self._priority(mb, False))
            try:
                with timeline.span("microbatch", mb=mb), self._task_context():
                    results[mb] = fn(*mb_inputs[mb][0], **mb_inputs[mb][1])
            except BaseException as exc:
                if not errors:
                    if getattr(exc, "_smp_cell", None) is None:
                        try:
                            exc._smp_cell = (0, mb, bool(_task.backward))
                        except AttributeError:
                            pass
                    payload = error_payload(exc)
                    for r in range(core.pp_size()):
                        self.p2p.send(r, _C.Message(-1, 0, K.ABORT, payload, []))
                errors.append(exc)
            finally:
                self.p2p.release_token()
                self.forward_finished(mb)  # a failed or eval microbatch must not block
                _task.mb = None

        self.workers.run([worker] * min(active, num_mb))
        self.records.clear()
        if errors:
            self.log_failure(errors[0])
            raise errors[0]
        out = (results, self.model._backward_this_step)
        payload = pickle.dumps(out)
        for r in range(1, core.pp_size()):
            self.p2p.send(r, _C.Message(-1, 0, K.STEP_END, payload, []))
        return out

    def _serve_step(self):
        self._serving = _ServingState()
        self.workers.run([self._serve_worker] * 2)  # one leads, one stands by
        try:
            msg = self.p2p.recv(-1, _C.ANY, _BIT[K.STEP_END] | _BIT[K.ABORT],
                                "the end of the step from the pipeline driver (pp rank 0)")
        finally:
            self.records.clear()
        if msg.kind == K.ABORT:
            exc, text = remote_exception(msg.meta)
            self.log_failure(exc)
            raise exc from RemoteTraceback(text)
        if self._serving.errors:
            raise self._serving.errors[0]
        return pickle.loads(msg.meta)

    # "simple": every microbatch's forward finishes before any backward starts.
    def forward_finished(self, mb):
        with self.fwd_cond:
            self.fwd_done.add(mb)
            self.fwd_cond.notify_all()

    def wait_all_forwards(self):
        if not self.schedule.forwards_before_backwards():
            return
        self.p2p.release_token()
        with self.fwd_cond:
            done = self.fwd_cond.wait_for(lambda: len(self.fwd_done) >= self.num_mb,
                                          timeout=self.cfg.timeout_s)
        self.p2p.acquire_token(self._priority(_task.mb, True))
        if not done:
            raise core.SMPTimeoutError(
                f"smp: timed out after {self.cfg.timeout_s} s waiting for every microbatch's "
                "forward ('simple' pipeline) before backward")

    def shutdown(self):
        self.workers.stop()
        self.p2p = None
