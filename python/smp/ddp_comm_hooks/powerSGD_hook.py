"""PowerSGD gradient compression (Vogels et al., 2019, https://arxiv.org/abs/1905.13727),
at the path and with the API of torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.

The hooks are C++ (hooks/powersgd.cpp) behind Python functions with torch's signature:
registered with `model.register_comm_hook(state, powerSGD_hook)` they run on the
reducer's comm thread with no Python on the hot path; registered on torch's
DistributedDataParallel they run there too (see smp/ddp_comm_hooks/_builtin.py). Each bucket's three allreduces (uncompressed rest, P,
Q) are issued in that order from that one thread, so any number of buckets works on
Gloo (torch 1.13's hook aborts there with two or more; its batched hook always fails).

Cost per compressed n x m matrix: (n + m) * rank elements sent instead of n * m, and
two (n x m) x (m x rank) products plus an orthogonalisation of each factor.
"""
import weakref

import numpy as np
import torch

import smp._C as _C
from smp.ddp_comm_hooks._builtin import run
from smp.groups import get_dp_process_group
from smp.process_state import is_initialized

__all__ = ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook"]


def powerSGD_hook(state, bucket):
    """torch's powerSGD_hook: each matrix of the bucket compressed to rank r.

    Args:
        state: a PowerSGDState (smp's).
        bucket: smp's or torch's GradBucket (runs under torch's DDP too, with any
            number of buckets on Gloo).
    """
    return run(powerSGD_hook, state, bucket)


def batched_powerSGD_hook(state, bucket):
    """torch's batched_powerSGD_hook: the whole bucket as one square matrix."""
    return run(batched_powerSGD_hook, state, bucket)


powerSGD_hook._smp_builtin = _C.powerSGD_hook
batched_powerSGD_hook._smp_builtin = _C.batched_powerSGD_hook

_OPTIONS = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
            "use_error_feedback", "warm_start", "orthogonalization_epsilon",
            "compression_stats_logging_frequency", "batch_tensors_with_same_shape")
_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression",
             "next_stats_report")
_TENSORS = ("error_dict", "p_memory_dict", "q_memory_dict")


def _config_error(msg):
    return _C.ConfigError(msg)


def _check_int(name, value):
    # Values are checked in C++ (hooks/powersgd.cpp), with the same message there.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise _config_error(f"smp: PowerSGDState {name}={value!r} must be an int")
    return int(value)


def _dp_group_or_none():
    return get_dp_process_group() if is_initialized() else None


class PowerSGDState:
    """The hyperparameters and per-bucket state of PowerSGD (torch's PowerSGDState).

    Args:
        process_group: group to reduce over; None: smp's dp group (the group of the
            model the hook is registered on), or torch's default group under torch's
            DistributedDataParallel.
        matrix_approximation_rank: rank r of M ~ P Q^T (>= 1); 1-4 is typical.
        start_powerSGD_iter: steps of plain averaging before compression starts.
        min_compression_rate: compress a matrix only if (n + m) * r * rate < n * m.
        use_error_feedback: add last step's compression error to this step's gradient
            (`error_feedback=` is accepted as an alias).
        warm_start: reuse last step's Q instead of a fresh random one.
        orthogonalization_epsilon: added to column norms (avoids NaN on zero columns).
        random_seed: seeds the initial Qs exactly as torch does (numpy's
            RandomState(random_seed), one torch seed per initialisation), so a run
            matches torch's hook with the same seed.
        compression_stats_logging_frequency: steps between stats reports.
        batch_tensors_with_same_shape: compress same-shaped tensors as one batch.

    Raises:
        smp.ConfigError (a ValueError): matrix_approximation_rank < 1;
            start_powerSGD_iter <= 1 with use_error_feedback or warm_start (the
            buckets are rebuilt after the first step); random_seed outside
            [0, 2**32 - 1].
    """

    def __init__(self, process_group=None, matrix_approximation_rank=1,
                 start_powerSGD_iter=1_000, min_compression_rate=2, use_error_feedback=True,
                 warm_start=True, orthogonalization_epsilon=0, random_seed=0,
                 compression_stats_logging_frequency=10_000,
                 batch_tensors_with_same_shape=False, error_feedback=None):
        if error_feedback is not None:
            use_error_feedback = error_feedback
        matrix_approximation_rank = _check_int("matrix_approximation_rank",
                                               matrix_approximation_rank)
        start_powerSGD_iter = _check_int("start_powerSGD_iter", start_powerSGD_iter)
        if isinstance(random_seed, bool) or not isinstance(random_seed, (int, np.integer)) \
                or not 0 <= random_seed <= 2**32 - 1:
            raise _config_error(f"smp: PowerSGDState random_seed={random_seed!r} must be an "
                                "int in [0, 2**32 - 1] (numpy's RandomState seeds)")
        self._native = _C.PowerSGDState(
            process_group, matrix_approximation_rank, start_powerSGD_iter,
            float(min_compression_rate), bool(use_error_feedback), bool(warm_start),
            float(orthogonalization_epsilon), int(random_seed),
            max(1, int(compression_stats_logging_frequency)),
            bool(batch_tensors_with_same_shape))
        self._process_group = process_group
        # Note [Hook state carries its layout]: the buckets a loaded state is indexed by
        # (adopted at registration), and the reducer this state is registered on.
        self._layout = None
        self._reducer = None

    # --- torch's attributes ------------------------------------------------------------

    @property
    def process_group(self):
        return self._process_group

    @process_group.setter
    def process_group(self, pg):
        self._native.process_group = pg
        self._process_group = pg

    def __getattr__(self, name):
        # Only reached for names not found normally: the options, counters and tensors.
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _OPTIONS or name == "random_seed":
            return self._native.options()[name]
        if name == "iter":
            return self._native.iter()
        if name in _COUNTERS or name in _TENSORS:
            return self._native.snapshot(False)[name]
        if name == "rng":
            return self.state_dict()["rng"]
        raise AttributeError(f"'PowerSGDState' object has no attribute '{name}'")

    def compression_stats(self):
        """(compress_rate, numel_before_compression, numel_after_compression) summed over
        every compressed step (rate 0 before the first), as torch's."""
        return tuple(self._native.compression_stats())

    def bytes_allreduced(self):
        """Bytes this rank gave to the hooks' allreduces so far (all steps)."""
        return self._native.bytes_allreduced()

    # --- state ------------------------------------------------------------------------

    def state_dict(self):
        """The state without the process group: torch's PowerSGDState fields (`rng` is a
        numpy RandomState) plus `random_seed` and `bucket_layout` (Note [Hook state
        carries its layout]). Tensors are copies."""
        snap = self._plain_state()
        rng = np.random.RandomState()
        rng.set_state(("MT19937", np.array(snap.pop("rng_key"), dtype=np.uint32),
                       snap.pop("rng_pos"), 0, 0.0))
        snap["rng"] = rng
        return snap

    # Note [Hook state carries its layout]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The error feedback and the memories are kept per bucket index, each tensor laid
    # out in its bucket's order. A fresh reducer lays out its first step as torch's DDP
    # constructor does (Note [Hook buckets follow torch's] in
    # smp_core/detail/reducer_rebuild.cpp), not as the saved run's rebuilt buckets were,
    # so a state saved by hand and registered on a fresh model used to land its rows on
    # other parameters for a step (3.8e-3 off the uninterrupted run on a one-bucket MLP).
    # The state saves the layout it is indexed by (`bucket_layout`: the buckets' parameter
    # indices, from the reducer it is registered on), and registering a loaded state
    # makes the reducer adopt that layout, as an automatic resume does: the resume is
    # bitwise whichever way the state was saved (a pickle, state_dict(), a checkpoint).
    # torch's own reload applies a state to its constructor's layout instead.
    def _plain_state(self):
        snap = self._native.snapshot(True)
        snap.pop("timeout_s", None)
        reducer = self._reducer() if self._reducer is not None else None
        snap["bucket_layout"] = [list(b) for b in reducer.bucket_indices()] \
            if reducer is not None else self._layout
        return snap

    def _smp_take_layout(self):
        """The layout a loaded state is indexed by, once (registration adopts it)."""
        layout, self._layout = self._layout, None
        return layout

    def _smp_attach(self, reducer):
        """Registered on `reducer` (smp/ddp_comm_hooks/__init__.py _install)."""
        self._reducer = weakref.ref(reducer)

    def load_state_dict(self, state_dict):
        """Loads what state_dict() (or torch's PowerSGDState.__getstate__(), or a pickle
        of this class) returned; training then continues exactly where it was saved.
        Keeps the process group."""
        d = dict(state_dict)
        layout = d.pop("bucket_layout", None)
        rng = d.pop("rng", None)
        if rng is not None:
            kind, key, pos, has_gauss, _ = rng.get_state()
            if kind != "MT19937" or has_gauss:
                raise _config_error(f"smp: PowerSGDState.load_state_dict: rng state {kind!r} "
                                    f"(has_gauss={has_gauss}) is not a fresh MT19937 "
                                    "RandomState")
            d["rng_key"] = [int(k) for k in key]
            d["rng_pos"] = int(pos)
        elif "rng_key" not in d or "rng_pos" not in d:
            raise _config_error("smp: PowerSGDState.load_state_dict: the state has no 'rng' "
                                "(nor 'rng_key' and 'rng_pos')")
        self._native.restore(d)
        self._layout = [[int(i) for i in b] for b in layout] if layout else None

    # Note [Hook state loads weights-only]: a pickle of the state holds plain data only
    # (numbers, lists, dicts of tensors): the random stream as its MT19937 key and
    # position, not a numpy RandomState, so torch.load's default weights-only unpickler
    # (torch >= 2.6) loads it once smp allows the class (smp/ddp_comm_hooks/_safe.py).
    # state_dict() keeps torch's fields, `rng` a RandomState, for torch's own loaders;
    # __setstate__ takes both, so pickles written before this keep loading.
    def __getstate__(self):
        return self._plain_state()

    def __setstate__(self, state):
        o = {k: state[k] for k in _OPTIONS if k in state}
        o["random_seed"] = int(state.get("random_seed", 0))
        # __init__ validates; a state saved before compression started may hold any iter.
        self.__init__(process_group=None, **o)
        self.load_state_dict(state)
        self.process_group = _dp_group_or_none()
