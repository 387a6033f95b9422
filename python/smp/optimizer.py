"""`smp.DistributedOptimizer`: returns the user's optimizer itself, with the SMP v1
state methods added, so it stays a torch.optim.Optimizer (LR schedulers keep working)
and keeps the Parameter objects it was built on.

State dicts:
- `local_state_dict()`: this pp rank's parameters only, keyed by parameter NAME (the
  model's `named_parameters`), marked `_smp_is_partial` and `_smp_by_name`; so a
  partial checkpoint loads into a job partitioned differently.
- `state_dict()`: the whole model's optimizer state in torch's own format (keyed by
  position, which is the same in every job running the same code): a plain torch
  optimizer over the unwrapped module's parameters loads it.
- `load_state_dict()` takes either; each rank keeps the state of its own parameters,
  taking entries other ranks read from the checkpoint (model_state.exchange).
"""
import types

import torch

from smp import auto_resume, grad_norm, join, process_state
from smp import mixed_precision, model_state, optimizer_sharding, tp_state
from smp.collectives import allgather, api_call
from smp.groups import CommGroup
from smp.ranks import pp_size, rank, tp_rank, tp_size

__all__ = []

_BY_NAME = "_smp_by_name"


def _groups(opt, full):
    """The optimizer's parameter lists: its own, or with `full` those it had before
    sharding kept this rank's (Note [Sharded optimizer state])."""
    if full and getattr(opt, "_smp_full_groups", None) is not None:
        return opt._smp_full_groups
    return [g["params"] for g in opt.param_groups]


def _param_names(opt, full=False):
    """Name of each of the optimizer's parameters, in torch's state_dict order (with
    `full`, a sharded optimizer's every parameter)."""
    model = process_state.state.model
    names = {}
    if model is not None:
        # The plain module's names, taken before partitioning replaced remote children.
        for name, p in model.plain_named_parameters():
            if isinstance(p, torch.nn.Parameter):
                names.setdefault(id(p), name)
    out = []
    for params in _groups(opt, full):
        for p in params:
            out.append(names.get(id(p), f"_smp_param_{len(out)}"))
    return out


def _local_ids():
    model = process_state.state.model
    if model is None or model.pipeline is None:
        return None  # everything is local
    return {id(p) for p in model.local_parameters()}


def _to_names(self, sd, full=False):
    """torch's positional dict -> {"state": {name: s}, "param_groups": [... names]}."""
    names = _param_names(self, full)
    state = {names[i]: s for i, s in sd["state"].items()}
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]]
    return _with_scaler({"state": state, "param_groups": groups}, sd)


def _renamed(sd, former):
    """A by-name state dict with its former parameter names made current
    (model_state.former_keys)."""
    names = model_state.renamed(list(sd["state"]) + [n for g in sd["param_groups"]
                                                    for n in g["params"]], former)
    if not names:
        return sd
    return dict(sd, state={names.get(n, n): s for n, s in sd["state"].items()},
                param_groups=[dict(g, params=[names.get(n, n) for n in g["params"]])
                              for g in sd["param_groups"]])


def _with_scaler(out, sd):
    """`out` with `sd`'s loss scaler state (Note [Master weights]), which is the same
    on every rank."""
    if mixed_precision.SCALER_KEY in sd:
        out[mixed_precision.SCALER_KEY] = sd[mixed_precision.SCALER_KEY]
    return out


def _local_state_dict(self, gather_if_shard=True, cast_to_cpu=False):
    """This pp rank's optimizer state by parameter name. A sharded optimizer (Note
    [Sharded optimizer state]) holds a share of it: with `gather_if_shard` (SMP v1's
    default) the dp group's shares are gathered (collective over the dp group), so
    the dp rank that writes a partial checkpoint writes all of it; without, this rank's
    share only."""
    sd = _to_names(self, self._smp_orig_state_dict())
    local = _local_ids()
    if local is not None:
        sd = _keep_local(sd, _param_names(self), _groups(self, full=False), local)
    if cast_to_cpu:
        sd["state"] = {n: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                       for n, s in sd["state"].items()}
    if gather_if_shard and optimizer_sharding.of(self) is not None:
        # Under tp the dp group spans tp x rdp, and a tp slice has the same name on every
        # tp rank: its state is taken from this tp rank's shares only (Note [Sharded tp
        # slices] in smp/optimizer_sharding.py), never another tp rank's piece.
        shares = allgather((tp_rank(), sd), CommGroup.DP_GROUP)
        cut = {n for n, m in _tp_marks(self, full=True).items() if tp_state.is_cut(m)}
        full = _param_names(self, full=True)
        sd = _with_scaler(
            {"state": {n: st for t, share in shares for n, st in share["state"].items()
                       if t == tp_rank() or n not in cut},
             "param_groups": [dict(g, params=[full[i] for i in g["params"]])
                              for g in _full_groups_by_position(self)]}, sd)
        if local is not None:
            sd = _keep_local(sd, full, _groups(self, full=True), local)
    sd[model_state.PARTIAL_KEY] = pp_size() > 1
    sd[_BY_NAME] = True
    if model_state.tp_degree() > 1:
        # Note [Slices in checkpoints] (smp/tp_state.py): a sliced parameter's state
        # tensors of its shape are slices too (of the whole group's, with a gathered share)
        sd[tp_state.TP_KEY] = tp_state.table(_tp_marks(self, full=True), sd["state"],
                                             tp_rank(), tp_size())
    return sd


def _tp_marks(self, full=False):
    """{parameter name: (dim, full shape, start, length)} of the tp-sliced parameters."""
    params = [p for ps in _groups(self, full) for p in ps]
    return {n: m for n, p in zip(_param_names(self, full), params)
            if (m := tp_state.mark_of(p)) is not None}


def _keep_local(sd, names, groups, local):
    """`sd` (by name) with only the parameters whose ids are in `local`; `names` names
    the parameters of `groups` in order."""
    params = [p for ps in groups for p in ps]
    keep = {n for n, p in zip(names, params) if id(p) in local}
    return _with_scaler({"state": {n: s for n, s in sd["state"].items() if n in keep},
                         "param_groups": [dict(g, params=[n for n in g["params"] if n in keep])
                                          for g in sd["param_groups"]]}, sd)


def _full_groups_by_position(self):
    """torch's param_groups entries over every parameter the optimizer had before
    sharding (positions in that order)."""
    groups, i = [], 0
    for saved, params in zip(self._smp_orig_state_dict()["param_groups"],
                             _groups(self, full=True)):
        groups.append(dict(saved, params=list(range(i, i + len(params)))))
        i += len(params)
    return groups


@api_call("optimizer.state_dict()")  # Note [Naming the call] in smp/collectives.py
def _state_dict(self, gather_to_rank0=False, cast_to_cpu=False):
    sharded = optimizer_sharding.of(self) is not None
    tp = model_state.tp_degree() > 1
    if _local_ids() is None and not sharded and not tp:
        return self._smp_orig_state_dict()
    local = _local_state_dict(self, gather_if_shard=False, cast_to_cpu=cast_to_cpu)
    if sharded:  # every dp rank holds a share (Note [Sharded optimizer state])
        parts = allgather(local, CommGroup.WORLD)
    else:
        # under tp the tp group's slices too, made full (Note [Slices in checkpoints])
        parts = model_state.gather_parts(local, gather_to_rank0)
        if parts is None:
            return {}
    if tp:
        state = model_state.full_of_parts(parts)["state"]
    else:
        state = {}
        for part in parts:
            state.update(part["state"])
    names = _param_names(self, full=True)
    index = {n: i for i, n in enumerate(names)}
    return _with_scaler({"state": {index[n]: s for n, s in state.items() if n in index},
                         "param_groups": _full_groups_by_position(self)}, local)


@api_call("optimizer.load_state_dict()")
def _load_state_dict(self, state_dict):
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
        raise ValueError("smp: DistributedOptimizer.load_state_dict: not an optimizer state "
                         "dict (no 'param_groups')")
    model = process_state.state.model
    if model is not None and model.pipeline is None and pp_size() > 1:
        self._smp_pending_state = state_dict  # loaded after partitioning (SMP v1)
        return None
    sd = dict(state_dict)
    scaler_state = sd.pop(mixed_precision.SCALER_KEY, None)
    partial = bool(sd.pop(model_state.PARTIAL_KEY, False))
    from_shards = bool(sd.pop(model_state.SHARDS_KEY, False))  # smp.save(..., v3=True)'s shares
    sd.pop(tp_state.TP_KEY, None)  # slices: their shapes say (Note [Slices in checkpoints])
    if not sd.pop(_BY_NAME, False):  # torch's positions: over every parameter
        sd = _to_names(self, sd, full=True)
    else:  # a save under former names (model_state.former_keys)
        sd = _renamed(sd, getattr(model, "_former_keys", None))
    names = _param_names(self)
    params = [p for g in self.param_groups for p in g["params"]]
    local = _local_ids()
    # A sharded optimizer keeps only its share: the others' entries are not read (the
    # division exists once the model is partitioned, before deferred loads apply).
    shard = getattr(getattr(model, "replica", None), "shard", None)
    needed = [n for n, p in zip(names, params)
              if (local is None or id(p) in local) and (shard is None or shard.keeps(p))]
    state = dict(sd["state"])
    if partial or from_shards:  # a sharded optimizer's entries may be on any rank
        group = (CommGroup.WORLD
                 if from_shards or optimizer_sharding.of(self) is not None else None)
        # Note [Sharded tp slices]: over the world a slice's state (one name on every
        # tp rank, another piece) comes only from a rank of this tp rank.
        sliced = [n for n, p in zip(names, params) if tp_state.mark_of(p) is not None]
        got, _ = model_state.exchange(state, needed, group, tag=tp_rank(), tagged=sliced)
        state.update(got)
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(self.param_groups):
        raise ValueError(f"smp: optimizer state has {len(saved_groups)} parameter groups, this "
                         f"optimizer {len(self.param_groups)} (rank {rank()})")
    torch_sd = {"state": {}, "param_groups": []}
    i = 0
    needed_set = set(needed)
    for saved, group in zip(saved_groups, self.param_groups):
        idx = list(range(i, i + len(group["params"])))
        i += len(idx)
        torch_sd["param_groups"].append(dict(saved, params=idx))
    marks = {}
    for j, n in enumerate(names):
        if n in needed_set and n in state:
            torch_sd["state"][j] = state[n]
            marks[j] = tp_state.mark_of(params[j])
    # A state read by entry (resume_from_checkpoint): what this rank keeps is verified,
    # then copied off the file's mapping (Note [Reads by entry] in checkpoint/mapped.cpp).
    entries = getattr(state_dict, "smp_entries", None)
    if entries is not None:
        entries.check([tp_state.state_sources(s, marks[j])
                       for j, s in torch_sd["state"].items()])
    # Note [Slices in checkpoints]: a sliced parameter's state tensors cut at its slice
    torch_sd["state"] = {j: tp_state.resolve_state(s, marks[j], names[j], copy=True)
                         for j, s in torch_sd["state"].items()}
    if entries is not None:
        torch_sd["state"] = entries.take(torch_sd["state"])
    if scaler_state is not None:
        torch_sd[mixed_precision.SCALER_KEY] = scaler_state
    # Note [Master weights]: the masters and the scaler go to smp, the rest to torch.
    return mixed_precision.load_state(self, torch_sd, self._smp_orig_load_state_dict)


def _step(self, *args, **kwargs):
    """The optimizer's own step, except those an automatic resume fast-forwards (Note
    [Automatic resume] in smp/auto_resume.py)."""
    if auto_resume.optimizer_step_skipped():
        return None
    # Note [Sharded optimizer state]: this rank's share, in rounds, exchanged as it goes.
    if mixed_precision.of(self) is None:
        return optimizer_sharding.step(self, self._smp_orig_step, args, kwargs)
    # Note [Master weights]: the overflow decided, the masters stepped, the scale moved.
    return mixed_precision.step(
        self, lambda own: optimizer_sharding.step(self, own, args, kwargs), self._smp_orig_step)


def _clip_master_grads(self, max_norm, norm_type=2):
    """SMP v1.10: clips the fp32 master gradients by their global norm over every rank
    holding part of the model (tied copies once, like model.clip_grad_norm_); returns
    the norm, or -1 when the step overflowed (nothing is clipped)."""
    grad_of = mixed_precision.master_grads(self)
    if grad_of is None:
        return -1
    return grad_norm.clip_grad_norm_(process_state.state.model, max_norm, norm_type,
                                     grad_of=grad_of)


def DistributedOptimizer(optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,  # noqa: N802
                         dynamic_loss_args=None, master_weights=True):
    """Adds `local_state_dict()` and partial-aware `state_dict`/`load_state_dict`;
    under config fp16/bf16, fp32 master weights and (fp16) loss scaling (Note [Master
    weights] in smp/mixed_precision.py).

    Args:
        optimizer: a torch.optim.Optimizer built on the model's parameters.
        static_loss_scale: fp16's constant loss scale (SMP v1.10), when not dynamic.
        dynamic_loss_scale: fp16: move the scale by the overflows (SMP v1.10).
        dynamic_loss_args: {init_scale, scale_factor, scale_window, min_scale,
            delayed_shift, consecutive_hysteresis} (SMP v1.10, Megatron's rules).
        master_weights: bf16: step fp32 master copies (default); False steps the bf16
            parameters themselves. fp16 always keeps masters.

    Returns:
        The same optimizer object, with `overflow`, `loss_scale` and
        `clip_master_grads(max_norm, norm_type=2)` added.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"smp.DistributedOptimizer: optimizer={optimizer!r} is not a "
                         "torch.optim.Optimizer")
    mixed_precision.setup_optimizer(optimizer, static_loss_scale, dynamic_loss_scale,
                                    dynamic_loss_args, master_weights)
    if not hasattr(optimizer, "_smp_orig_state_dict"):
        own_state_dict = optimizer.state_dict
        optimizer._smp_orig_state_dict = (
            lambda: mixed_precision.add_state(optimizer, own_state_dict()))
        optimizer._smp_orig_load_state_dict = optimizer.load_state_dict
        optimizer.clip_master_grads = types.MethodType(_clip_master_grads, optimizer)
        optimizer._smp_pending_state = None
        optimizer.state_dict = types.MethodType(_state_dict, optimizer)
        optimizer.load_state_dict = types.MethodType(_load_state_dict, optimizer)
        optimizer.local_state_dict = types.MethodType(_local_state_dict, optimizer)
        optimizer._smp_orig_step = optimizer.step
        optimizer.step = types.MethodType(_step, optimizer)
        join.make_optimizer_joinable(optimizer)  # Join([model, optimizer]) (smp/join.py)
    process_state.state.optimizer = optimizer
    # A model already partitioned.
    optimizer_sharding.install(process_state.state.model, optimizer)
    return optimizer
