"""Mixed precision (SMP v1.10): config `"fp16": true` or `"bf16": true`.

Note [Half-precision model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
- The model's floating-point parameters and buffers are kept in the config's dtype on
  the rank that owns them, cast in place once the first step has partitioned the model
  (each Parameter keeps its Python object, so the optimizer still holds it). A model
  built under `smp.delay_param_initialization` is materialized straight into that
  dtype, one recording at a time, so no rank ever holds its part in fp32;
  `smp.model_creation(dtype=...)` (smp/tp_substitution.py) builds the modules in it
  from the start (torch's default dtype inside the block).
- `smp.DistributedOptimizer` keeps an fp32 master copy of each half-precision
  parameter it steps (Note [Master weights]); bf16 too, unless
  `master_weights=False`.
- fp16 scales the loss (`model.backward(loss)` multiplies by `optimizer.loss_scale`):
  static or dynamic, SMP v1.10's arguments, the scale moved by C++'s LossScaler after
  the job-wide overflow decision (Note [One overflow decision] in
  smp_core/loss_scale.cpp). An overflowing step is skipped on every rank.

Note [Master weights]
~~~~~~~~~~~~~~~~~~~~~
The optimizer's param_groups keep the model's half-precision Parameters, so its state
is keyed by them as always (sharding, names, state dicts and schedulers see the model's
parameters). Only its own step sees the masters: for the parameters being stepped (all
of them, or one round of a sharded step: Note [Sharded optimizer state]) the groups
hold the fp32 masters and the state is keyed by them while torch's step runs, each
master's .grad being the model gradient in fp32 divided by the loss scale; then each
model parameter takes its master's value, rounded. A master is made from its
parameter at the first step that steps it, so with sharding each rank holds masters
for its share only. `optimizer.state_dict()` carries the masters (each parameter's
state entry '_smp_fp32_master') and the loss scaler's state ('_smp_loss_scaler'):
a resume continues bitwise.
"""
import contextlib

import torch

import smp._C as _C
from smp import process_state
from smp.groups import gradient_span_group
from smp.nested import map_leaves

__all__ = []

MASTER_KEY = "_smp_fp32_master"
SCALER_KEY = "_smp_loss_scaler"
_DYNAMIC_KEYS = ("init_scale", "scale_factor", "scale_window", "min_scale", "delayed_shift",
                 "consecutive_hysteresis")


def model_dtype():
    """The dtype the config keeps the model in (fp16, bf16), or None."""
    cfg = getattr(process_state.state, "cfg", None)
    if cfg is None:
        return None
    if getattr(cfg, "fp16", False):
        return torch.float16
    if getattr(cfg, "bf16", False):
        return torch.bfloat16
    return None


_HALF = (torch.float16, torch.bfloat16)


def cast_module(module, later=lambda t: False):
    """Note [Half-precision model]: at wrap time, every floating-point parameter and
    buffer of `module` that has a value (or is a meta tensor without a recorded init),
    in place, so the first step's trace runs the model as it will train. Those that
    `later(t)` names (a deferred model's recorded tensors) are cast as they are
    materialized instead."""
    _cast([t for t in list(module.parameters()) + list(module.buffers()) if not later(t)])


def _cast(tensors):
    """Each floating-point tensor of `tensors`, in place (its Python object kept), to
    the config's dtype."""
    dtype = model_dtype()
    if dtype is None:
        return
    with torch.no_grad():
        for t in tensors:
            if t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)


def cast_inputs(args, kwargs):
    """The model's floating-point tensor inputs in the config's dtype (as torch FSDP's
    `cast_forward_inputs`): a batch of fp32 features meets fp16 weights otherwise."""
    dtype = model_dtype()
    if dtype is None:
        return args, kwargs
    return map_leaves((args, kwargs), lambda t: t.to(dtype),
                      lambda x: isinstance(x, torch.Tensor) and x.is_floating_point()
                      and x.dtype != dtype)


def cast_model(model):
    """Note [Half-precision model]: this rank's floating-point parameters and buffers,
    in place, to the config's dtype (nothing without fp16/bf16)."""
    _cast(list(model.local_parameters()) + list(model.local_buffers()))


# --- the optimizer's side -------------------------------------------------------------

class _Precision:
    """What DistributedOptimizer adds under fp16/bf16: the masters, the loss scaler,
    the overflow of the last step (Note [Master weights])."""

    def __init__(self, scaler, master_weights):
        self.scaler = scaler            # _C.LossScaler (fp16) or None
        self.master_weights = master_weights
        self.masters = {}               # id(model parameter) -> fp32 master
        self.prepared = False           # masters' .grad set for this step
        self.overflow = None            # this step's decision (None: not decided yet)


def _dynamic_args(args):
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise _C.ConfigError(f"smp.DistributedOptimizer: dynamic_loss_args={args!r} is not "
                               f"a dict (allowed keys: {', '.join(_DYNAMIC_KEYS)})")
    out = {}
    for k, v in args.items():
        if isinstance(v, bool):
            v = float(v)
        if not isinstance(v, (int, float)):
            raise _C.ConfigError(
                f"smp.DistributedOptimizer: dynamic_loss_args[{k!r}]={v!r} is not a number"
                + ("" if k in _DYNAMIC_KEYS else
                   f" (and {k!r} is not a key: allowed keys: {', '.join(_DYNAMIC_KEYS)})"))
        out[str(k)] = float(v)
    return out


def setup_optimizer(optimizer, static_loss_scale, dynamic_loss_scale, dynamic_loss_args,
                    master_weights):
    """Checks DistributedOptimizer's mixed-precision arguments (on every rank: each
    makes the same call) and attaches their state to `optimizer`."""
    dtype = model_dtype()
    if static_loss_scale is not None and not isinstance(static_loss_scale, (int, float)):
        raise _C.ConfigError(f"smp.DistributedOptimizer: static_loss_scale="
                               f"{static_loss_scale!r} is not a number (allowed: a number > 0)")
    if dynamic_loss_args is not None and not dynamic_loss_scale:
        raise _C.ConfigError("smp.DistributedOptimizer: dynamic_loss_args is given with "
                               "dynamic_loss_scale=False (allowed: dynamic_loss_scale=True "
                               "with dynamic_loss_args, or neither)")
    if dynamic_loss_scale:
        scaler = _C.LossScaler.dynamic(_dynamic_args(dynamic_loss_args))
    else:
        scaler = _C.LossScaler.fixed(1.0 if static_loss_scale is None else
                                     float(static_loss_scale))
    if dtype == torch.float16 and master_weights is False:
        raise _C.ConfigError("smp.DistributedOptimizer: master_weights=False with config "
                               "'fp16'=true (allowed: True; fp16 steps need fp32 master "
                               "weights, only bf16 may go without)")
    # Without fp16 the loss-scaling arguments are checked (above) and then unused, as in
    # SMP v1.10 ("effective only for FP16 training"): AWS's GPT-2 example passes
    # static_loss_scale=None, dynamic_loss_scale=True with its args in every precision.
    keep = dtype is not None and master_weights is not False
    optimizer._smp_precision = (_Precision(scaler if dtype == torch.float16 else None, keep)
                                if dtype is not None else None)
    optimizer.overflow = False
    optimizer.loss_scale = scaler.scale if dtype == torch.float16 else 1.0
    if dtype is not None:
        # SMP v1.10's fp16 optimizer is a wrapper whose `.optimizer` is torch's (Hugging
        # Face's Trainer builds its LR scheduler on it); here they are one object.
        optimizer.optimizer = optimizer
    return optimizer


def of(optimizer):
    return getattr(optimizer, "_smp_precision", None)


def loss_scale():
    """The scale model.backward() multiplies the loss by (1.0 unless fp16)."""
    mp = of(getattr(process_state.state, "optimizer", None))
    if mp is None or mp.scaler is None:
        return 1.0
    return mp.scaler.scale


# --- the overflow decision ------------------------------------------------------------

_OVERFLOW = {"check": None, "model": None, "wanted": False}


def want_overflow_check():
    """A GradScaler (smp's, or torch's used on an smp optimizer) needs the step's
    overflow agreed: from now on each step's finish decides it."""
    _OVERFLOW["wanted"] = True


def overflow_check(model):
    """The OverflowCheck of `model`'s finish, or None when no one needs it: fp16 with
    dynamic scaling, or a GradScaler (Note [One overflow decision])."""
    mp = of(getattr(process_state.state, "optimizer", None))
    dynamic = mp is not None and mp.scaler is not None and mp.scaler.dynamic_scaling
    if not (dynamic or _OVERFLOW["wanted"]) or model is None or not model.partitioned:
        return None
    if _OVERFLOW["model"] is not model:
        params = list(model.local_parameters())
        # Note [Sharded optimizer state]; under tp an overflow in one rank's slice must
        # skip the step on every rank of the replica.
        group = gradient_span_group(model.replica.shard is not None)
        _OVERFLOW["check"] = _C.OverflowCheck(params, group, process_state.state.cfg.timeout_s)
        _OVERFLOW["model"] = model
    return _OVERFLOW["check"]


def found_overflow():
    """This step's agreed overflow (taken: the next step decides anew). Where no finish
    decided it (partitions == 1, or a scaler that appeared mid-run) it is decided now,
    on the main thread, where every rank makes the same call."""
    model = getattr(process_state.state, "model", None)
    check = overflow_check(model) if model is not None else None
    if check is None:
        return False
    got = check.take()
    if got is None:
        check.run()
        got = check.take()
    return bool(got)


def reset():
    """smp.shutdown(): forget the model's check."""
    _OVERFLOW.update(check=None, model=None, wanted=False)


# --- the optimizer's step -------------------------------------------------------------

def _pairs(optimizer, mp):
    """(model parameter, master) of each half-precision parameter in the groups now."""
    out = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.dtype in _HALF:
                m = mp.masters.get(id(p))
                if m is None:
                    m = torch.nn.Parameter(p.detach().float().clone(),
                                           requires_grad=p.requires_grad)
                    mp.masters[id(p)] = m
                out.append((p, m))
    return out


def _prepare(optimizer, mp):
    """Each master's .grad: the model gradient, fp32, divided by the loss scale (once
    per step)."""
    if mp.prepared:
        return
    inv = 1.0 / mp.scaler.scale if mp.scaler is not None else 1.0
    for p, m in _pairs(optimizer, mp):
        if p.grad is None:
            m.grad = None
            continue
        g = p.grad.detach().float()  # a copy: masters are of half-precision parameters
        m.grad = g.mul_(inv) if inv != 1.0 else g
    mp.prepared = True


def decide(optimizer):
    """The step's overflow, decided once per optimizer step (fp16 only)."""
    mp = of(optimizer)
    if mp.overflow is None:
        mp.overflow = (found_overflow() if mp.scaler is not None and mp.scaler.dynamic_scaling
                       else False)
        optimizer.overflow = mp.overflow
    return mp.overflow


def step(optimizer, sharded_step, own_step):
    """optimizer.step() under fp16/bf16 (Note [Master weights]): decides the overflow,
    moves the loss scale, and (no overflow) steps the masters and copies them back.
    `sharded_step(own)` is the step as sharding runs it, `own` being torch's step of
    the parameters in the groups now."""
    mp = of(optimizer)
    overflow = decide(optimizer)
    try:
        if overflow:
            return None  # skipped on every rank (Note [One overflow decision])
        if not mp.master_weights:
            return sharded_step(own_step)
        return sharded_step(lambda *a, **k: _on_masters(optimizer, mp, own_step, a, k))
    finally:
        if mp.scaler is not None:
            mp.scaler.update(overflow)
            optimizer.loss_scale = mp.scaler.scale
        for m in mp.masters.values():
            m.grad = None  # the fp32 gradients live for one step only
        mp.prepared = False
        mp.overflow = None


def _on_masters(optimizer, mp, own_step, args, kwargs):
    """torch's step with the groups' half-precision parameters replaced by their
    masters (state keyed by the masters meanwhile), then copied back, rounded."""
    if not mp.prepared:
        _prepare(optimizer, mp)
    pairs = _pairs(optimizer, mp)
    if not pairs:
        return own_step(*args, **kwargs)
    try:
        with _masters_in_groups(optimizer, pairs):
            return own_step(*args, **kwargs)
    finally:
        with torch.no_grad():
            for p, m in pairs:
                p.copy_(m)


@contextlib.contextmanager
def _masters_in_groups(optimizer, pairs):
    """Inside: each (parameter, master) of `pairs` has its master in the param groups,
    and its optimizer state keyed by the master."""
    saved = [g["params"] for g in optimizer.param_groups]
    by_id = {id(p): m for p, m in pairs}
    state = optimizer.state
    for p, m in pairs:
        if p in state:
            state[m] = state.pop(p)
    for g in optimizer.param_groups:
        g["params"] = [by_id.get(id(p), p) for p in g["params"]]
    try:
        yield
    finally:
        for g, ps in zip(optimizer.param_groups, saved):
            g["params"] = ps
        for p, m in pairs:
            if m in state:
                state[p] = state.pop(m)


def master_grads(optimizer):
    """For SMP v1.10's `optimizer.clip_master_grads`: None when this step overflowed
    (nothing to clip); else `grad_of(p)`, the gradient to count and clip for model
    parameter p: its fp32 master's (the model gradient divided by the loss scale), or
    p.grad where it has no master."""
    mp = of(optimizer)
    if mp is None or not mp.master_weights:
        return lambda p: p.grad
    if decide(optimizer):
        return None
    _prepare(optimizer, mp)
    master_of = {id(p): m for p, m in _pairs(optimizer, mp)}
    return lambda p: master_of[id(p)].grad if id(p) in master_of else p.grad


# --- state dicts ----------------------------------------------------------------------

def add_state(optimizer, sd):
    """torch's positional state dict `sd` of `optimizer`, with the masters (each
    parameter's entry) and the loss scaler."""
    mp = of(optimizer)
    if mp is None:
        return sd
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = dict(sd["state"])
    for i, p in enumerate(params):
        m = mp.masters.get(id(p))
        if m is not None:
            state[i] = dict(state.get(i, {}), **{MASTER_KEY: m.detach()})
    sd = dict(sd, state=state)
    if mp.scaler is not None:
        scale, it, last, hyst = mp.scaler.state()
        sd[SCALER_KEY] = {"scale": scale, "iter": it, "last_overflow_iter": last,
                          "hysteresis": hyst, "dynamic": mp.scaler.dynamic_scaling}
    return sd


def load_state(optimizer, sd, own_load):
    """Loads torch's positional `sd` with what add_state() added: the masters and the
    scaler go to smp; the rest to torch's `own_load`, run with the masters in the
    groups, so the state of a parameter that has one is loaded in fp32, as it was
    saved (torch casts each state tensor to its parameter's dtype)."""
    sd = take_state(optimizer, sd)
    mp = of(optimizer)
    if mp is None or not mp.master_weights:
        return own_load(sd)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    pairs = [(p, mp.masters[id(p)]) for p in params if id(p) in mp.masters]
    with _masters_in_groups(optimizer, pairs):
        return own_load(sd)


def take_state(optimizer, sd):
    """Loads what add_state() added into `optimizer` and returns `sd` without it (what
    torch's load_state_dict takes). Masters are keyed by position in `sd`."""
    mp = of(optimizer)
    scaler_state = sd.get(SCALER_KEY)
    sd = {k: v for k, v in sd.items() if k != SCALER_KEY}
    masters = {}
    state = {}
    for i, s in sd.get("state", {}).items():
        if isinstance(s, dict) and MASTER_KEY in s:
            masters[i] = s[MASTER_KEY]
            s = {k: v for k, v in s.items() if k != MASTER_KEY}
        state[i] = s
    sd["state"] = state
    if mp is None:
        return sd
    if scaler_state is not None and mp.scaler is not None:
        mp.scaler.set_state(scaler_state["scale"], scaler_state["iter"],
                            scaler_state["last_overflow_iter"], scaler_state["hysteresis"])
        optimizer.loss_scale = mp.scaler.scale
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, value in masters.items():
        # (a load before the first step meets the parameters before their cast)
        if i < len(params) and mp.master_weights:
            p = params[i]
            m = mp.masters.get(id(p))
            v = value.detach().to(device=p.device, dtype=torch.float32)
            if m is None:
                mp.masters[id(p)] = torch.nn.Parameter(v.clone(), requires_grad=p.requires_grad)
            else:
                with torch.no_grad():
                    m.copy_(v)
    return sd

