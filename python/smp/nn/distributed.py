"""Tensor parallelism's building blocks (SMP v1.6+): the base `DistributedModule`, the
slices a tp rank holds of a linear map, and `DistributedLinear` and
`DistributedEmbedding`.

What is cut, where, and what crosses the tp group is decided in C++
(smp_core/tensor_parallel.{h,cpp}, Note [Entering and leaving a distributed module]);
this file builds modules on it. Each distributed module draws its *full* weights the
way the reference module does (the same torch calls in the same order, so the same
seed gives the same weights whatever tp is) and keeps its slice. A parameter cut
across the tp group carries `_smp_tp_dim`, `_smp_tp_full_shape` and `_smp_tp_slice`
(start, length); the others are replicated over the group. See
docs/tensor_parallel.md.
"""
import contextlib
import threading

import torch
import torch.nn.functional as F

import smp._C as _C

__all__ = []

_local = threading.local()


def tp_group():
    """(size, rank, prescaled_batch) of this rank's tp group; (1, 0, False) before
    smp.init or with tensor_parallel_degree 1."""
    return _C.tp_group()


@contextlib.contextmanager
def outermost():
    """Around a distributed module's forward. In the outermost one running on this
    thread, the first `enter` checks that the tp group's inputs agree in shape (an
    error on every rank instead of a hang); the inner modules' shapes follow."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    if depth == 0:
        _local.pending = True
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            _local.pending = False


def enter(x, what, check=None):
    """The tensor a distributed block computes on: the tp group's batches gathered
    (each rank its own batch) or `x` (prescaled_batch). Tensors without grad (masks,
    ids) take the same path; bool ones travel as uint8. `check` None: check shapes
    if this is the outermost module's first enter."""
    if x is None:
        return None
    if check is None:
        check = getattr(_local, "pending", False)
        _local.pending = False
    if x.dtype == torch.bool:
        return _C.tp_enter(x.to(torch.uint8), check, what).bool()
    return _C.tp_enter(x, check, what)


def enter_mask(mask, rows, s_q, s_k, dtype, device, what):
    """The tp group's attention masks, gathered like `enter` gathers a batch, as additive
    masks of one shape. A rank may hold none where another holds one: Hugging Face
    drops a mask of all ones, which depends on each rank's own rows. So the ranks first
    gather what each holds (a tiny tensor), then each brings its mask, or zeros, as
    [rows, 1, q, s_k] (q: 1, or s_q if any rank's mask varies by query); a bool mask
    (True: attend) becomes 0 / the dtype's minimum. Returns None if no rank has one.
    With prescaled_batch (one batch) or tp = 1 the mask is returned as it is."""
    size, _, prescaled = tp_group()
    if size == 1 or prescaled:
        return mask
    by_query = mask is not None and mask.dim() >= 2 and mask.shape[-2] != 1
    held = torch.tensor([[0 if mask is None else 1, s_q if by_query else 1]], dtype=torch.long,
                        device=device)
    held = _C.tp_enter(held, False, what + " (which ranks hold a mask)").cpu()
    if not bool(held[:, 0].any()):
        return None
    q = int(held[:, 1].max())
    if mask is None:
        mask = torch.zeros(rows, 1, q, s_k, dtype=dtype, device=device)
    else:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min)
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        mask = mask.to(dtype).expand(rows, 1, q, s_k).contiguous()
    return _C.tp_enter(mask, False, what)


def leave(y, what):
    """Each rank's summand of a block's output summed over the tp group: this rank's
    rows of it (each rank its own batch) or all of it (prescaled_batch)."""
    return _C.tp_leave(y, what)


def dropout(x, p, training, full_shape, dim=0, start=0, length=0):
    """`x` dropped as the reference drops the whole tensor of `full_shape`, of which
    `x` is the slice [start, start + length) along `dim` (length 0: `x` is whole)."""
    if not training or p == 0.0:
        return x
    return _C.tp_dropout(x, float(p), bool(training), list(full_shape), dim, start, length)


def rows_dropout(x, p, training):
    """Dropout of a block's output after `leave`: the reference drops the tp group's
    whole batch, of which `x` holds this rank's rows (or all of it, prescaled)."""
    if not training or p == 0.0:
        return x
    size, rank, prescaled = tp_group()
    if size == 1 or prescaled:
        return dropout(x, p, training, x.shape)
    n = x.shape[0]
    return dropout(x, p, training, (n * size,) + tuple(x.shape[1:]), 0, rank * n, n)


def _mark(param, dim, full_shape, start, length):
    param._smp_tp_dim = dim
    param._smp_tp_full_shape = tuple(full_shape)
    param._smp_tp_slice = (start, length)
    return param


class DistributedModule(torch.nn.Module):
    """Base of smp.nn's tensor-parallel modules (SMP's
    `smdistributed.modelparallel.torch.nn.DistributedModule`).

    `load_state_dict` takes either this rank's slices or the full tensors (of
    `_smp_tp_full_shape`), which it cuts: a full state dict of the reference module
    (translated to these names) loads into every tp rank.

    Its children stay on its pipeline partition (`_smp_pinned_children`, Note [Blocks
    stay whole] in partition/partition.cpp): its forward uses their tensors directly.
    A container of blocks (a layer, the stack) pins none, or only the children it
    reaches into.
    """

    _smp_pinned_children = True

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        for name, param in self._parameters.items():
            key = prefix + name
            if param is None or key not in state_dict or not hasattr(param, "_smp_tp_dim"):
                continue
            value = state_dict[key]
            if (tuple(value.shape) == param._smp_tp_full_shape
                    and tuple(value.shape) != tuple(param.shape)):
                start, length = param._smp_tp_slice
                state_dict[key] = value.narrow(param._smp_tp_dim, start, length)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)


def _init_linear(full, use_normal_initialization, initializer_range):
    if use_normal_initialization:
        with torch.no_grad():
            full.weight.normal_(mean=0.0, std=initializer_range)
            if full.bias is not None:
                full.bias.zero_()


class CutLinear(DistributedModule):
    """This rank's part of a linear map `in_features` -> `out_features` cut `cut`:
    "column" keeps rows of the weight and of the bias (a slice of the output
    features); "row" keeps columns of the weight (a slice of the input features) and
    the whole bias, which `add_bias` adds once, after the summands are summed.

    The full nn.Linear is drawn first, so the weights are the reference's.
    """

    def __init__(self, in_features, out_features, bias=True, cut="column", what="linear",
                 use_normal_initialization=False, initializer_range=0.02):
        super().__init__()
        size, rank, _ = tp_group()
        self.in_features, self.out_features, self.cut = in_features, out_features, cut
        full = torch.nn.Linear(in_features, out_features, bias=bias)
        _init_linear(full, use_normal_initialization, initializer_range)
        dim, start, length = _C.tp_slice(what, cut, [out_features, in_features], size, rank)
        self.weight = _mark(torch.nn.Parameter(full.weight.detach().narrow(dim, start, length)
                                               .clone()), dim, full.weight.shape, start, length)
        if bias and cut == "column":
            self.bias = _mark(torch.nn.Parameter(full.bias.detach().narrow(0, start, length)
                                                 .clone()), 0, full.bias.shape, start, length)
        elif bias:
            self.bias = torch.nn.Parameter(full.bias.detach().clone())
        else:
            self.register_parameter("bias", None)
        self.slice = (dim, start, length)

    def forward(self, x):
        """Column: the whole input to this rank's output features (bias included).
        Row: this rank's input features to its summand of the output (no bias)."""
        if self.cut == "column":
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight)

    def add_bias(self, y):
        return y if self.bias is None or self.cut == "column" else y + self.bias

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"cut={self.cut}, local_weight={tuple(self.weight.shape)}")


class DistributedLinear(CutLinear):
    """nn.Linear(in_features, out_features) cut across the tp group by input features
    (a row cut): rank t keeps columns [t*in/tp, (t+1)*in/tp) of the weight; the bias
    is replicated and added once. `in_features` and `out_features` are the global
    sizes, as in SMP; `in_features` must be divisible by tensor_parallel_degree.

    It holds `weight` and `bias` itself, so a substituted nn.Linear keeps its names in
    state dicts, checkpoints and the optimizer's state. Before, they were a child's
    (`linear.weight`, `linear.bias`): `_smp_former_names` lets such a checkpoint load
    (smp.model_state.former_keys).

    Forward takes and returns what nn.Linear does (each rank its own batch, or the
    group's one batch with prescaled_batch); one collective each way.
    """

    _smp_former_names = {"linear.weight": "weight", "linear.bias": "bias"}

    def __init__(self, in_features, out_features, bias=True, **_hints):
        super().__init__(in_features, out_features, bias, "row", "DistributedLinear in_features")

    def _load_from_state_dict(self, state_dict, prefix, *args):
        # (a load into this module itself; smp.DistributedModel renames for the model)
        for old, new in self._smp_former_names.items():
            if prefix + old in state_dict and prefix + new not in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x):
        with outermost():
            full = enter(x, "DistributedLinear")
            _, start, length = self.slice
            part = F.linear(full.narrow(-1, start, length), self.weight)
            return self.add_bias(leave(part, "DistributedLinear"))

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}"


class DistributedEmbedding(DistributedModule):
    """nn.Embedding cut across the tp group along `embedding_dim` (SMP v1.10), weights
    drawn N(0, initializer_range) (the padding row zero). `_skip_allgather`: the ids
    are already the tp group's batch; `_skip_scatter_and_merge`: return this rank's
    features of the whole group's batch instead of all features of its own rows."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None,
                 norm_type=2.0, scale_grad_by_freq=False, sparse=False, _weight=None,
                 initializer_range=0.02, _skip_allgather=False,
                 _skip_scatter_and_merge=False, **_hints):
        super().__init__()
        if max_norm is not None or sparse:
            raise _C.ConfigError(
                f"smp.nn.DistributedEmbedding: max_norm={max_norm!r}, sparse={sparse!r} "
                "are not supported (allowed: max_norm=None, sparse=False)")
        size, rank, _ = tp_group()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.scale_grad_by_freq = scale_grad_by_freq
        self.skip_allgather, self.skip_scatter = _skip_allgather, _skip_scatter_and_merge
        if _weight is not None:
            full = _weight.detach()
        else:
            full = torch.empty(num_embeddings, embedding_dim)
            full.normal_(mean=0.0, std=initializer_range)
            if padding_idx is not None:
                full[padding_idx].zero_()
        dim, start, length = _C.tp_slice("DistributedEmbedding embedding_dim", "embedding_dim",
                                         [num_embeddings, embedding_dim], size, rank)
        self.weight = _mark(torch.nn.Parameter(full.narrow(dim, start, length).clone()),
                            dim, full.shape, start, length)
        self.slice = (dim, start, length)

    def local(self, ids):
        """This rank's features of `ids`' embeddings (no communication)."""
        return F.embedding(ids, self.weight, self.padding_idx, None, 2.0,
                           self.scale_grad_by_freq, False)

    def merge(self, part, what="DistributedEmbedding"):
        """This rank's features of the group's batch -> all features of its own rows:
        each rank's features placed in a zero tensor of the full width and summed."""
        _, start, length = self.slice
        if length == self.embedding_dim:
            return part
        full = F.pad(part, (start, self.embedding_dim - start - length))
        return leave(full, what)

    def forward(self, ids):
        with outermost():
            if not self.skip_allgather:
                ids = enter(ids, "DistributedEmbedding")
            part = self.local(ids)
            return part if self.skip_scatter else self.merge(part)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, local_dim={self.slice[2]}"
