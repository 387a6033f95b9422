"""State dicts of `smp.DistributedModel` across pipeline ranks (SMP v1 semantics).

Everything is keyed by the plain module's state-dict names (a tied parameter appears
under each of its names, as in `module.state_dict()`), never by position, so a
checkpoint taken with one partitioning loads into another: `_exchange` moves each
entry from a rank that holds it to the rank that owns it.
"""
import collections
import zlib

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from smp import agreement, tp_state
from smp.collectives import agree_call, allgather, api_call
from smp.groups import (CommGroup, get_mp_process_group, get_pp_process_group,
                        get_tp_process_group)
from smp.process_state import is_initialized, state
from smp.ranks import get_pp_group, members, pp_rank, pp_size, rank, tp_rank, tp_size

__all__ = []

PARTIAL_KEY = "_smp_is_partial"
# smp.load of smp.save(..., v3=True) shards: entries of the dict may be on any rank of
# the world (checkpoint/_api.py).
SHARDS_KEY = "_smp_from_shards"
# Note [Compiled names]
# ~~~~~~~~~~~~~~~~~~~~~
# torch.compile(module) returns an OptimizedModule that holds the module as its child
# `_orig_mod`, so the module's state-dict keys and parameter names gain `_orig_mod.`
# components (before the whole name, or inside it for a compiled submodule). Compiling
# is a way of running the same model: smp's names drop those components, so the
# names, state dicts and checkpoints of a model are the same with and without
# torch.compile (before or after wrapping), and a load accepts keys with or without
# them (a state dict of a compiled plain module loads into smp, and smp's into one).
COMPILED = "_orig_mod"


def canonical_key(key):
    """`key` without torch.compile's `_orig_mod` components (Note [Compiled names])."""
    if COMPILED not in key:
        return key
    return ".".join(p for p in key.split(".") if p != COMPILED)


def former_keys(module):
    """{former state key: key} of the modules in `module` that renamed their state: a
    class's `_smp_former_names` {old name: name} (smp.nn.DistributedLinear held its
    `weight`/`bias` as `linear.weight`/`linear.bias` before), so that a checkpoint
    written under the old names still loads. Keys are canonical (Note [Compiled
    names])."""
    out = {}
    for prefix, m in module.named_modules():
        names = getattr(type(m), "_smp_former_names", None)
        if not names:
            continue
        p = canonical_key(prefix) + "." if prefix else ""
        for old, new in names.items():
            out[p + old] = p + new
    return out


def renamed(keys, former):
    """{key: the key it loads as}: a former key (see former_keys) becomes the current
    one unless `keys` holds that one too."""
    if not former:
        return {}
    have = {canonical_key(k) for k in keys}
    out = {}
    for k in keys:
        new = former.get(canonical_key(k))
        if new is not None and new not in have:
            out[k] = new
    return out


def exchange(have, needed, group=None, tag=None, tagged=()):
    """Gives every rank of `group` (the pp group by default) the entries it needs that
    other ranks hold.

    Args:
        have: this rank's entries {name: value}.
        needed: the names this rank needs.
        tag: this rank's tag (e.g. its tp rank), and `tagged` the names in `needed`
            that only a rank of the same tag may provide (a tp slice's state: one name
            on every tp rank, a different piece; Note [Sharded tp slices] in
            smp/optimizer_sharding.py).

    Returns:
        {name: value} for the names in `needed` that this rank lacks and another rank
        holds (the lowest such rank of the group provides it; of the same tag for a
        tagged name), and the union of every rank's names. Collective over `group`;
        moves only the entries some rank lacks.
    """
    group = CommGroup.PP_GROUP if group is None else group
    if not is_initialized() or len(members(group)) == 1:
        return {}, set(have)
    me = members(group).index(rank())
    tagged = set(tagged)
    infos = allgather((sorted(have), sorted(needed), tag, sorted(tagged & set(needed))),
                      group)
    holders = collections.defaultdict(list)
    for r, (keys, _, _, _) in enumerate(infos):
        for k in keys:
            holders[k].append(r)

    def provider(k, want_tag, only_tag):
        rs = [r for r in holders.get(k, ()) if not only_tag or infos[r][2] == want_tag]
        return rs[0] if rs else None

    provide = set()
    for r, (keys, wants, t, only) in enumerate(infos):
        own, only = set(keys), set(only)
        for k in wants:
            if k not in own and provider(k, t, k in only) == me:
                provide.add(k)
    sent = allgather({k: have[k] for k in sorted(provide)}, group)
    got = {}
    mine = set(have)
    for k in needed:
        if k in mine:
            continue
        src = provider(k, tag, k in tagged)
        if src is not None and k in sent[src]:
            got[k] = sent[src][k]
    return got, set(holders)


class _StateWithEntries(dict):
    """A deferred load's state, still carrying its `smp_entries` (see load_state_dict)."""

    smp_entries = None


def gather_to_pp0(obj):
    """pp rank 0 gets [obj of pp rank 0, 1, ...]; other ranks get None. A gather, not an
    allgather: only pp rank 0 receives."""
    if pp_size() == 1:
        return [obj]
    group = get_pp_process_group()
    dst = get_pp_group()[0]
    out = [None] * pp_size() if pp_rank() == 0 else None
    agree_call(CommGroup.PP_GROUP, "smp.gather(PP_GROUP)")
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def tp_degree():
    """tensor_parallel_degree (1 before smp.init)."""
    return tp_size() if is_initialized() else 1


def gather_to_first(obj, group):
    """The first member of `group` (the lowest rank) gets [obj of each member]; the
    others get None."""
    if len(members(group)) == 1:
        return [obj]
    pg = {CommGroup.TP_GROUP: get_tp_process_group,
          CommGroup.MP_GROUP: get_mp_process_group}[group]()
    dst = members(group)[0]
    out = [None] * len(members(group)) if rank() == dst else None
    agree_call(group, f"smp.gather({'TP' if group == CommGroup.TP_GROUP else 'MP'}_GROUP)")
    dist.gather_object(obj, out, dst=dst, group=pg)
    return out


def gather_parts(local, gather_to_rank0):
    """Every rank's `local` of this replica (the mp group: pp x tp), or with
    `gather_to_rank0` only on its first member (None elsewhere); without tensor
    parallelism the pp group's, gathered to pp rank 0 (SMP v1)."""
    if tp_degree() == 1:
        return gather_to_pp0(local) if gather_to_rank0 else allgather(local, CommGroup.MP_GROUP)
    group = CommGroup.MP_GROUP if pp_size() > 1 else CommGroup.TP_GROUP
    return gather_to_first(local, group) if gather_to_rank0 else allgather(local, group)


def full_of_parts(parts):
    """One full state from local state dicts of the ranks of a replica: the tp ranks'
    slices concatenated (Note [Slices in checkpoints] in smp/tp_state.py)."""
    if not tp_state.has_table(parts):
        merged = {}
        for part in parts:
            merged.update(part)
        return merged

    def first_wins(objs):
        out = {}
        for o in objs:
            for k, v in o.items():
                if k == "state" and isinstance(v, dict) and isinstance(out.get(k), dict):
                    out[k] = {**v, **out[k]}
                else:
                    out.setdefault(k, v)
        return out
    return tp_state.materialize(tp_state.merge(parts, first_wins))


class ModelStateMixin:
    """`local_state_dict`, `state_dict`, `load_state_dict` and the hooks of
    DistributedModel. Uses the model's `_owner`, `_state_tensors`, `_state_shapes`,
    `_pending_state`, `_deferred`, `_former_keys` (former_keys of the module)."""

    # --- helpers ------------------------------------------------------------------------

    def plain_named_parameters(self):
        """(state-dict name, Parameter) of the plain module, as it was before partitioning
        replaced the children other ranks own (a tied Parameter under each name)."""
        if self._state_tensors is None:
            return [(canonical_key(k), v) for k, v in self.module.named_parameters()]
        return [(canonical_key(k), v) for k, v in self._state_tensors.items()
                if isinstance(v, torch.nn.Parameter)]

    @property
    def _plan_hash(self):
        plan = getattr(self, "_plan", None)
        if not plan:
            return 0
        return zlib.crc32(repr([(n, p) for n, p, _ in plan]).encode()) or 1

    def _to_model_keys(self, sd):
        """`sd` with each key mapped onto the model's own key of the same canonical name
        (Note [Compiled names]); other keys stay as they are."""
        keys = self._all_state_keys()
        if not any(COMPILED in k for k in keys) and not any(COMPILED in k for k in sd):
            return sd
        table = {canonical_key(k): k for k in keys}
        return {table.get(canonical_key(k), k): v for k, v in sd.items()}

    def _all_state_keys(self):
        if self._state_tensors is not None:
            return list(self._state_tensors)
        return list(self.module.state_dict(keep_vars=True))

    def _owned_keys(self):
        if self._owner is None:
            return self._all_state_keys()
        me = pp_rank()
        return [k for k in self._state_tensors if self._key_owner(k) == me]

    def _require_values(self, what):
        """A deferred model (smp/deferred_init.py) has no values before its first step."""
        if self._deferred:
            raise RuntimeError(
                f"smp: {what} of a model built under smp.delay_param_initialization has no "
                "values before the first step, which partitions it and initializes each "
                "rank's part; call it after the first @smp.step call")

    def _check_shapes(self, sd, partial):
        """Every tensor of `sd` has the shape of the model's tensor of that name; raised
        the same on every pp rank (a full dict is the same on every rank; the entries
        of a partial one differ, so the ranks agree)."""
        shapes = self._state_shapes  # taken at partitioning: other ranks' are released
        if shapes is None:
            shapes = {k: tuple(t.shape)
                      for k, t in self.module.state_dict(keep_vars=True).items()}
        bad = []
        marks = self._tp_marks()
        for k, v in sd.items():
            want = shapes.get(k)
            mark = marks.get(k)
            if isinstance(v, tp_state.Slices):  # Note [Slices in checkpoints]
                if mark is not None and v.full_shape != mark[1] or \
                        mark is None and want is not None and v.full_shape != want:
                    bad.append(f"'{k}': checkpoint {list(v.full_shape)}, model "
                               f"{list(mark[1] if mark is not None else want)}")
                continue
            # a full tensor where the model holds a tp slice is cut when loaded
            if torch.is_tensor(v) and want is not None and tuple(v.shape) != want and \
                    not (mark is not None and tuple(v.shape) == mark[1]):
                bad.append(f"'{k}': checkpoint {list(v.shape)}, model {list(want)}")
        error = None
        if bad:
            error = RuntimeError(f"smp: load_state_dict: tensors whose shape differs from "
                                 f"the model's: {', '.join(bad)}")
        if partial and is_initialized() and pp_size() > 1:
            agreement.agree(error, CommGroup.PP_GROUP,
                            agreement.first_error("model.load_state_dict()"))
        elif error is not None:
            raise error

    def _module_state(self, cast_to_cpu, *args, **kwargs):
        """The unpartitioned module's state dict under smp's names (Note [Compiled
        names]), its tensors detached CPU copies with `cast_to_cpu`."""
        return collections.OrderedDict(
            (canonical_key(k), v.detach().cpu() if cast_to_cpu and torch.is_tensor(v) else v)
            for k, v in self.module.state_dict(*args, **kwargs).items())

    def _rank_tag(self):
        if not is_initialized():
            return "rank 0"
        return f"rank {rank()} (pp rank {pp_rank()})"

    # --- state dicts --------------------------------------------------------------------

    def local_state_dict(self, *args, cast_to_cpu=True, **kwargs):
        """This rank's part of the state dict, with key `_smp_is_partial`.

        Args:
            cast_to_cpu: return CPU tensors (the default, as SMP).
        """
        self._require_values("local_state_dict()")
        if self._owner is None:
            sd = self._module_state(cast_to_cpu, *args, **kwargs)
        else:
            sd = collections.OrderedDict()
            for k in self._owned_keys():
                v = self._state_tensors[k].detach()
                sd[canonical_key(k)] = v.cpu() if cast_to_cpu else v
        sd[PARTIAL_KEY] = pp_size() > 1
        if tp_degree() > 1:
            # Note [Slices in checkpoints] (smp/tp_state.py): which entries are slices
            marks = {canonical_key(k): m for k, m in self._tp_marks().items()}
            sd[tp_state.TP_KEY] = tp_state.table(marks, sd, tp_rank(), tp_size())
        return sd

    def _tp_marks(self):
        """{state key: (dim, full shape, start, length)} of the tp-sliced tensors."""
        src = self._state_tensors
        if src is None:
            src = self.module.state_dict(keep_vars=True)
        marks = {}
        for k, v in src.items():
            m = tp_state.mark_of(v)
            if m is not None:
                marks[k] = m
        return marks

    @api_call("model.state_dict()")  # Note [Naming the call] in smp/collectives.py
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False,
                   gather_to_rank0=False, cast_to_cpu=True):
        """The full model's state dict, with exactly the plain module's keys (without
        torch.compile's `_orig_mod.`, Note [Compiled names]).

        With partitions > 1 this is collective over the mp group (SMP v1: call it on
        every rank with dp_rank() == 0, or on every rank).

        Args:
            destination, prefix, keep_vars: torch's (a module holding this model as a
                child, torch.compile's OptimizedModule among them, passes them): the
                entries are added to `destination` under `prefix`, which is returned.
            gather_to_rank0: only pp rank 0 receives the full dict (a gather); the other
                ranks return an empty dict.
            cast_to_cpu: CPU tensors.
        """
        if args:  # torch's deprecated positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (tuple(args) + (destination, prefix,
                                                             keep_vars)[len(args):])[:3]
        sd = self._full_state_dict(keep_vars, gather_to_rank0, cast_to_cpu)
        if destination is None:
            return sd
        prefix = canonical_key(prefix)
        for k, v in sd.items():
            destination[prefix + k] = v
        return destination

    def _full_state_dict(self, keep_vars, gather_to_rank0, cast_to_cpu):
        self._require_values("state_dict()")
        tp = tp_degree() > 1 and not keep_vars  # (keep_vars: this rank's Parameters)
        if self._owner is None and not tp:
            return self._module_state(cast_to_cpu and not keep_vars, keep_vars=keep_vars)
        local = self.local_state_dict(cast_to_cpu=cast_to_cpu)
        local.pop(PARTIAL_KEY)
        # Note [Slices in checkpoints]: under tp the slices are gathered over the tp
        # group and concatenated, so the full dict loads into the plain module.
        parts = gather_parts(local, gather_to_rank0)
        if parts is None:
            return collections.OrderedDict()
        merged = full_of_parts(parts)
        keys = (canonical_key(k) for k in (self._state_tensors if self._state_tensors
                                           is not None else local))
        return collections.OrderedDict((k, merged[k]) for k in keys if k in merged)

    @api_call("model.load_state_dict()")
    def load_state_dict(self, state_dict, strict=True, same_partition_load=False):
        """Loads a full or a partial state dict, before or after partitioning.

        A partial dict (`_smp_is_partial`) holds some ranks' entries: each rank takes
        what it owns from the dicts of the whole mp group (collective over it, unless
        `same_partition_load=True` says every rank already holds its own). Before the
        first step the load waits for the partition (SMP v1).

        Raises:
            RuntimeError: with strict=True, missing or unexpected keys (named, with the
                rank); raised on every rank.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"smp: load_state_dict: state_dict of type "
                             f"{type(state_dict).__name__} is not a dict")
        # A state read by entry (resume_from_checkpoint): its tensors are verified when
        # kept (Note [Reads by entry] in checkpoint/mapped.cpp).
        entries = getattr(state_dict, "smp_entries", None)
        sd = dict(state_dict)
        names = renamed(sd, self._former_keys)  # a save under former names (former_keys)
        if names:
            sd = {names.get(k, k): v for k, v in sd.items()}
        sd = self._to_model_keys(self._from_hf(sd))
        partial = bool(sd.pop(PARTIAL_KEY, False))
        sd.pop(tp_state.TP_KEY, None)  # slices: their shapes say (Note [Slices in checkpoints])
        if self._owner is None and (pp_size() > 1 or self._deferred):
            # (a deferred model, smp/deferred_init.py, has no tensors to load into yet)
            pending = _StateWithEntries(sd, **{PARTIAL_KEY: partial})
            pending.smp_entries = entries
            self._pending_state = (pending, strict, same_partition_load)
            return None
        self._check_shapes(sd, partial and not same_partition_load)
        keys = self._all_state_keys()
        key_set = set(keys)
        owned = self._owned_keys()
        if partial and not same_partition_load:
            got, everywhere = exchange(sd, owned)
            sd.update(got)
        else:
            everywhere = set(sd)
        missing = [k for k in keys if k not in everywhere]
        my_missing = [k for k in owned if k not in sd]
        unexpected = [k for k in sd if k not in key_set] if not partial else \
            sorted(k for k in everywhere if k not in key_set)
        named = lambda ks: [canonical_key(k) for k in ks]  # noqa: E731
        if strict and (missing or unexpected or my_missing):
            raise RuntimeError(
                f"smp: load_state_dict on {self._rank_tag()}: missing keys "
                f"{named(missing or my_missing)}, unexpected keys {named(unexpected)}")
        # Note [Slices in checkpoints]: each tensor this rank keeps, cut at its tp slice
        # (its own saved piece, or cut from the pieces or from a full tensor).
        marks = self._tp_marks()
        kept = [k for k in sd if k in key_set] if self._owner is None else \
            [k for k in owned if k in sd]
        if entries is not None:
            entries.check([tp_state.sources(sd[k], marks.get(k)) for k in kept])
            entries = None
        for k in kept:
            sd[k] = tp_state.resolve(sd[k], marks.get(k), canonical_key(k))
        if self._owner is None:
            with torch.no_grad():
                result = self.module.load_state_dict(
                    {k: v for k, v in sd.items() if k in key_set}, strict=False)
            return torch.nn.modules.module._IncompatibleKeys(
                named(result.missing_keys), named(unexpected))
        with torch.no_grad():
            for k in owned:
                if k in sd:
                    self._state_tensors[k].copy_(sd[k])
        return torch.nn.modules.module._IncompatibleKeys(named(missing or my_missing),
                                                         named(unexpected))

    def _from_hf(self, sd):
        """`sd` in smp's names when it is a Hugging Face state dict of a substituted
        model (a full checkpoint saved with translate_if_full): SMP 1.10's registered
        translations (`smp.state.module_manager.translate_functions`), the first that
        leaves no key unknown to the model."""
        fns = state.module_manager.translate_functions
        if not fns:
            return sd
        keys = set(self._all_state_keys())
        special = {PARTIAL_KEY, tp_state.TP_KEY}
        unknown = [k for k in sd if k not in keys and k not in special
                   and canonical_key(k) not in keys]
        if not unknown:
            return sd
        for _, hf_to_smp in fns:
            try:
                got = hf_to_smp(sd)
            except Exception:  # noqa: BLE001  (not this translation's model)
                continue
            if all(k in keys or k in special for k in got):
                return got
        return sd

    # Note [Loaded as a child]
    # ~~~~~~~~~~~~~~~~~~~~~~~~
    # torch's Module.load_state_dict on a module holding this model (a user's container,
    # or torch.compile's OptimizedModule: Note [Compiled names]) does not call this
    # model's load_state_dict: it calls _load_from_state_dict on every module of the
    # tree with the keys under its prefix. Here the model takes every key under its
    # prefix (the plain module's keys, as its state_dict gives them) and loads them as
    # load_state_dict does, partitions included; its own children then must not load
    # them again (at partitions > 1 most of their tensors are released), so they are
    # out of the tree until the load's post hook puts them back.
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        try:
            result = self.load_state_dict(sub, strict=False)
        except Exception as e:  # noqa: BLE001  (torch reports its errors in error_msgs)
            error_msgs.append(str(e))
            result = None
        if result is not None:
            missing_keys.extend(prefix + k for k in result.missing_keys)
            unexpected_keys.extend(prefix + k for k in result.unexpected_keys)
        if self._hides_children:
            self.__dict__["_hidden_children"] = self.__dict__["_modules"]
            self.__dict__["_modules"] = collections.OrderedDict()

    def _children_back(self, _module, _incompatible):
        hidden = self.__dict__.pop("_hidden_children", None)
        if hidden is not None:
            self.__dict__["_modules"] = hidden

    def _apply_pending_state(self):
        """Called by _partition once the plan is known: the deferred model load, then
        the optimizer's (SMP v1: loads happen after the partition)."""
        if self._pending_state is not None:
            sd, strict, same = self._pending_state
            self._pending_state = None
            self.load_state_dict(sd, strict, same)
        opt = state.optimizer
        if opt is not None and getattr(opt, "_smp_pending_state", None) is not None:
            pending = opt._smp_pending_state
            opt._smp_pending_state = None
            opt.load_state_dict(pending)

    # --- hooks --------------------------------------------------------------------------

    def register_post_partition_hook(self, hook):
        """`hook(model, optimizer)` runs after partitioning (the first step, before its
        first forward); registered after that, it runs at once. Returns a handle."""
        if not callable(hook):
            raise ValueError(f"smp: register_post_partition_hook hook={hook!r} is not callable")
        if not isinstance(self._post_partition_hooks, collections.OrderedDict):
            self._post_partition_hooks = collections.OrderedDict(self._post_partition_hooks)
        handle = RemovableHandle(self._post_partition_hooks)
        self._post_partition_hooks[handle.id] = hook
        if self.partitioned:
            hook(self, state.optimizer)
        return handle

    def register_post_step_hook(self, hook):
        """`hook(model, optimizer)` runs once, after the next `@smp.step` call returns
        (the first step, for a hook registered before training: SMP v1). Hugging Face's
        Trainer loads a resumed optimizer state this way. Returns a handle."""
        if not callable(hook):
            raise ValueError(f"smp: register_post_step_hook hook={hook!r} is not callable")
        if not isinstance(self._post_step_hooks, collections.OrderedDict):
            self._post_step_hooks = collections.OrderedDict(self._post_step_hooks)
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = hook
        return handle

    def _run_post_step_hooks(self):
        """After a step returned: each registered post-step hook runs once, then is gone
        (a hook registering another defers that one to the next step)."""
        hooks = list(self._post_step_hooks.values())
        self._post_step_hooks.clear()
        for hook in hooks:
            hook(self, state.optimizer)
