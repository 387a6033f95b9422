"""Deferred parameter initialization: `smp.delay_param_initialization` (SMP v1's name).

A model built inside the context holds no parameter storage: its tensors are meta
tensors (shapes and dtypes only), and every operation the model's `__init__` runs on
them is recorded. `smp.DistributedModel` traces the model on meta tensors, partitions
it, and then each rank materializes only the tensors it owns by replaying the
recorded operations that lead to them.

Note [Replayed init]
~~~~~~~~~~~~~~~~~~~~
The promise is that a deferred model's values equal those of the same model built
eagerly from the same seed, bit for bit, on every rank. Two things make that hold:

- Random operations (those torch tags `nondeterministic_seeded`: `uniform_`,
  `normal_`, `randn`, ...) draw from a generator whose state depends on every draw
  before. While recording, each random operation runs once more on a scratch tensor
  of the same geometry, right after its generator's state is saved: the generator
  advances exactly as in the eager build (so the user's code after the model sees the
  same random numbers), the scratch tensor is freed at once (peak memory: one
  tensor), and replaying the operation later from the saved state draws the same
  numbers whatever ran between.
- Tensors are identified by their storage, not by their Python object: views
  (`weight[0].fill_(0)`), `.data`, `Parameter(...)` and tied weights all share one.
  An operation is recorded with a (storage, dtype, size, stride, offset) reference
  for each deferred tensor, so replay rebuilds each view over the real storage, and
  a rank replays exactly the operations that write the storages it keeps (and, for
  what those read, the storages they read from).

A model built under `torch.device("meta")` outside the context has no record: the
owned modules are allocated and `reset_parameters()` initializes them, which cannot
equal an eager build; a warning says so and names the modules that have no
`reset_parameters()` (their values are left uninitialized).

torch's FSDP initializes meta-device modules with `reset_parameters()` and makes no
promise of equality; torchdistx records and replays operations in C++. This is the
replay, with the generator states saved so a partial replay is exact.
"""
import contextlib
import ctypes
import ctypes.util
import functools
import resource
import warnings
import weakref

import torch

from smp import agreement, memory_estimate, nested, optimizer_sharding
from smp.groups import CommGroup
from smp.process_state import is_initialized
from smp.ranks import size

__all__ = []

_RECORDINGS = []   # every recording whose storages some live tensor still uses


def _supported():
    return hasattr(torch.Tensor, "untyped_storage") and hasattr(torch, "Tag")


def _key(t):
    return t.untyped_storage()._cdata


class _Ref:
    """A deferred tensor inside a recorded operation: a view of a recorded storage."""
    __slots__ = ("key", "dtype", "size", "stride", "offset")

    def __init__(self, t):
        self.key, self.dtype = _key(t), t.dtype
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()


class _Storage:
    """A recorded storage: held while its recording is open (no other storage can take
    its key then), weakly afterwards (Note [Recording's lifetime])."""
    __slots__ = ("meta", "ref", "device", "nbytes")

    def __init__(self, meta, device):
        self.meta, self.ref, self.device, self.nbytes = meta, None, device, meta.nbytes()

    def storage(self):
        return self.meta if self.ref is None else self.ref()


class _Op:
    __slots__ = ("func", "args", "kwargs", "reads", "writes", "outs", "rng")

    def __init__(self, func, args, kwargs, reads, writes, outs, rng):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.reads, self.writes, self.outs, self.rng = reads, writes, outs, rng


def _is_tensor(x):
    return isinstance(x, torch.Tensor)


def _written_args(func, args, kwargs):
    """The tensor arguments `func` writes in place (its schema's `Tensor(a!)`)."""
    written = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        written.extend(nested.tensor_leaves(value))
    return written


class Recording:
    """The storages a deferred build created and the operations that wrote them."""

    def __init__(self):
        self.storages = {}  # storage key -> _Storage
        self.ops = []
        self.paused = False  # running an init function for real (record_call)
        self.live = None     # recorded storages still alive, once closed

    def covers(self, t):
        if not t.is_meta:
            return False
        s = self.storages.get(_key(t))
        return s is not None and s.storage() is t.untyped_storage()

    # Note [Recording's lifetime]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A recording is needed while some tensor still uses one of its storages (a module
    # not materialized yet); its operations may hold real tensors the build copied from,
    # so it must not outlive them all. While the context is open it holds its storages
    # (no new storage can reuse a recorded one's key); at the exit it holds them weakly
    # (torch keeps one Python object per storage, so the weak reference lives exactly as
    # long as the storage), `covers` compares identity (a later storage at a dead one's
    # address is not ours), and the last storage to die drops the recording.
    def close(self):
        self.live = len(self.storages) + 1  # each death counts down, as does this call
        for s in self.storages.values():
            s.ref, s.meta = weakref.ref(s.meta, self._died), None
        self._died(None)

    def _died(self, _ref):
        self.live -= 1
        if self.live == 0:
            self._drop()

    def _drop(self):
        if self in _RECORDINGS:
            _RECORDINGS.remove(self)

    def device_of(self, t):
        return self.storages[_key(t)].device

    # --- recording ---------------------------------------------------------------------

    def record(self, func, args, kwargs):
        """Runs `func` on meta tensors in place of the deferred ones and records it;
        returns its (meta) result, or NotImplemented for an operation not ours."""
        if self.paused:
            return NotImplemented
        tensors = nested.tensor_leaves((args, kwargs))
        deferred = [t for t in tensors if self.covers(t)]
        device = kwargs.get("device")
        factory = not tensors and device is not None and torch.device(device).type != "meta"
        if not deferred and not factory:
            return NotImplemented
        device = torch.device(device) if factory else self.device_of(deferred[0])
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError(
                "smp.delay_param_initialization: the model's construction reads the value "
                f"of a tensor being initialized ({func}, e.g. .item() or a Python if on a "
                "tensor); deferred initialization has no values to give. Build this model "
                "without the context")
        meta_kwargs = dict(kwargs, device=torch.device("meta")) if factory else kwargs

        def to_meta(x):
            return x if x.is_meta else x.to("meta")
        try:
            out = func(*nested.map_leaves(args, to_meta, _is_tensor),
                       **nested.map_leaves(meta_kwargs, to_meta, _is_tensor))
        except Exception as e:
            raise RuntimeError(f"smp.delay_param_initialization: {func} failed on a deferred "
                               f"tensor: {e}") from e
        writes = {_key(t) for t in _written_args(func, args, kwargs) if self.covers(t)}
        outs = []
        for o in nested.tensor_leaves(out):
            if o.is_meta and _key(o) not in self.storages:
                self.storages[_key(o)] = _Storage(o.untyped_storage(), device)
                writes.add(_key(o))
                outs.append(_key(o))
            else:
                outs.append(None)
        if not writes:  # a view or a query: replay rebuilds views from the references
            return out
        rng = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            rng = self._draw_as_eager(func, args, kwargs, device)
        self.ops.append(_Op(func, self._refs(args), self._refs(kwargs),
                            {_key(t) for t in deferred}, writes, outs, rng))
        return out

    def _refs(self, value):
        """`value` with each deferred tensor replaced by its _Ref."""
        return nested.map_leaves(value, _Ref, lambda x: _is_tensor(x) and self.covers(x))

    def record_call(self, fn, tensor, args, kwargs):
        """Records `fn(tensor, *args, **kwargs)`, a torch.nn.init function, as one
        operation (Note [Init functions]): runs it once on the tensor's real value
        (replayed) so the generator advances as in an eager build, and saves the
        generator's state before it."""
        key = _key(tensor)
        device = self.storages[key].device
        generator = kwargs.get("generator")
        # The state first: a small allocation made after the tensor's would sit above
        # it in the heap and keep its pages once it is freed (Note [Recording's heap]).
        state = _generator_state(generator, device)
        self.paused = True
        try:
            real = self.replay({key})[key]
            fn(_view(real, _Ref(tensor), device), *args, **kwargs)
        finally:
            self.paused = False
        del real
        release_free_heap()
        reads = {key} | {_key(t) for t in nested.tensor_leaves((args, kwargs)) if self.covers(t)}
        self.ops.append(_Op(fn, (_Ref(tensor),) + self._refs(tuple(args)), self._refs(kwargs),
                            reads, {key}, [], (generator, device, state)))
        return tensor

    def _draw_as_eager(self, func, args, kwargs, device):
        """Saves the generator's state, then runs `func` on scratch tensors so the
        generator advances as in an eager build (Note [Replayed init])."""
        generator = kwargs.get("generator")
        state = _generator_state(generator, device)
        scratch = {}

        def real(x):
            k = _key(x)
            if k not in scratch:
                scratch[k] = _zeros_storage(self.storages[k].nbytes, device)
            return _view(scratch[k], _Ref(x), device)

        def deferred(x):
            return _is_tensor(x) and self.covers(x)
        func(*nested.map_leaves(args, real, deferred), **nested.map_leaves(kwargs, real, deferred))
        scratch.clear()
        release_free_heap()
        return generator, device, state

    # --- replay ------------------------------------------------------------------------

    def replay(self, keys):
        """Real storages for the storage `keys` (and nothing kept besides): runs, in
        recorded order, every operation that writes one of them or something they read.
        Returns {key: UntypedStorage}."""
        needed = set(keys)
        while True:  # the closure over what the needed writes read
            grown = set(needed)
            for op in self.ops:
                if op.writes & grown:
                    grown |= op.reads
            if grown == needed:
                break
            needed = grown
        real = {}
        before = {}  # each generator's state before the replay, restored after it

        def resolve(x):
            s = self.storages[x.key]
            if x.key not in real:  # written but not needed: scratch
                real[x.key] = _zeros_storage(s.nbytes, s.device)
            return _view(real[x.key], x, s.device)

        def is_ref(x):
            return isinstance(x, _Ref)
        try:
            for op in self.ops:
                if not op.writes & needed:
                    continue
                if op.rng is not None:
                    generator, device, state = op.rng
                    which = id(generator) if generator is not None else str(device)
                    if which not in before:
                        before[which] = (generator, device,
                                         _generator_state(generator, device))
                    _set_generator_state(generator, device, state)
                out = op.func(*nested.map_leaves(op.args, resolve, is_ref),
                              **nested.map_leaves(op.kwargs, resolve, is_ref))
                for k, o in zip(op.outs, nested.tensor_leaves(out)):
                    if k is not None:
                        real[k] = o.untyped_storage()
        finally:
            for generator, device, state in before.values():
                _set_generator_state(generator, device, state)
        return {k: real[k] for k in keys if k in real}


# Note [Recording's heap]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Recording runs each random init on a tensor that is freed at once. glibc's malloc
# serves blocks up to 32 MiB from its heap once a larger one was freed (its mmap
# threshold follows the blocks freed), and keeps freed heap pages when anything
# allocated later sits above them: a 284M-parameter GPT's recording left 630 MB
# resident that nothing used (all of it given back by malloc_trim). So every
# transient tensor's release is followed by malloc_trim(0), which returns the free
# pages anywhere in the heap; the resident set stays at what is live plus one tensor.
_TRIM = []


def release_free_heap():
    """Returns glibc's free heap pages to the system (a no-op elsewhere)."""
    if not _TRIM:
        try:
            _TRIM.append(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim)
        except (OSError, AttributeError):
            _TRIM.append(None)
    if _TRIM[0] is not None:
        _TRIM[0](0)


def _zeros_storage(nbytes, device):
    return torch.zeros(nbytes, dtype=torch.uint8, device=device).untyped_storage()


def _view(storage, ref, device):
    t = torch.empty(0, dtype=ref.dtype, device=device)
    return t.set_(storage, ref.offset, ref.size, ref.stride)


def _generator_state(generator, device):
    if generator is not None:
        return generator.get_state()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_generator_state(generator, device, state):
    if generator is not None:
        generator.set_state(state)
    elif device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


# Note [Private dispatch API]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# TorchDispatchMode lives in a private torch module (torch.utils._python_dispatch)
# that torch may move or change between releases. It is imported in the two functions
# that use it, which run only on a torch that _supported() accepts, so `import smp`
# never depends on it: a torch without it loses deferred initialization, not smp.
def _make_mode():
    from torch.utils._python_dispatch import TorchDispatchMode  # Note [Private dispatch API]

    class _Recorder(TorchDispatchMode):
        def __init__(self, recording):
            super().__init__()
            self.recording = recording

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = self.recording.record(func, args, kwargs or {})
            if out is NotImplemented:
                return func(*args, **(kwargs or {}))
            return out
    return _Recorder


@contextlib.contextmanager
def delay_param_initialization(enabled=True):
    """Builds the model inside without parameter storage (SMP v1's name).

        with smp.delay_param_initialization(enabled=True):
            model = MyModel()
        model = smp.DistributedModel(model)  # each rank allocates what it owns

    The values each rank gets equal those of the model built eagerly from the same
    seed (Note [Replayed init] in smp/deferred_init.py), and the random generator
    after the block is where the eager build would have left it.

    Raises:
        ValueError: `enabled` is not a bool.
        RuntimeError: this torch cannot record (torch < 2.0), or the construction
            reads a tensor's value.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"smp.delay_param_initialization: enabled={enabled!r} is not one "
                         "of {True, False}")
    if not enabled:
        yield
        return
    if not _supported():
        raise RuntimeError("smp.delay_param_initialization needs torch >= 2.0 (storage "
                           f"identity and operator tags); this is torch {torch.__version__}")
    recording = Recording()
    _RECORDINGS.append(recording)
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS
             if hasattr(torch.nn.init, name)}
    try:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, _recorded_init(fn))
        _ACTIVE.append(recording)
        with _make_mode()(recording):
            yield
    finally:
        if _ACTIVE and _ACTIVE[-1] is recording:
            _ACTIVE.pop()
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)
        recording.close()  # Note [Recording's lifetime]


# Note [Init functions]
# ~~~~~~~~~~~~~~~~~~~~~
# torch.nn.init's functions return at once on a meta tensor (torch >= 2.x skips
# `trunc_normal_`, `orthogonal_`, `dirac_`, `sparse_` there), and some read the values
# they draw (`trunc_normal_` redraws until every value lies in [a, b]), so their aten
# operations cannot be recorded on meta tensors. Inside the context each of them is
# recorded whole instead: the call runs once on the tensor's real value, rebuilt by
# replay, with the generator's state saved before, and replay calls it again.
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
                   "eye_", "dirac_", "xavier_uniform_", "xavier_normal_",
                   "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


_ACTIVE = []   # the open recordings, innermost last
_WRAPPED = {}  # torch.nn.init function -> its recording wrapper


def _recorded_init(fn):
    """`fn` recorded whole when its tensor belongs to the innermost open recording. The
    wrapper names no recording (torch may keep the functions it saw; a recording must
    not live on through them, Note [Recording's lifetime]), and is made once per `fn`."""
    if fn in _WRAPPED:
        return _WRAPPED[fn]

    @functools.wraps(fn)
    def init(tensor, *args, **kwargs):
        recording = _ACTIVE[-1] if _ACTIVE else None
        if recording is not None and isinstance(tensor, torch.Tensor) and \
                recording.covers(tensor) and not recording.paused:
            with torch.no_grad():
                return recording.record_call(fn, tensor, args, kwargs)
        return fn(tensor, *args, **kwargs)
    _WRAPPED[fn] = init
    return init


# --- materialization (smp.DistributedModel) ---------------------------------------------

def state_tensors(module):
    """(qualified name, owning module, attribute, tensor) of every parameter and buffer
    under `module`, each tensor object once (its first name)."""
    seen, out = set(), []
    for mname, m in module.named_modules(remove_duplicate=False):
        for attr, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            out.append((f"{mname}.{attr}" if mname else attr, m, attr, t))
    return out


def is_deferred(module):
    """Whether any parameter or buffer of `module` is a meta tensor."""
    return any(t.is_meta for _, _, _, t in state_tensors(module))


def _recording_of(t):
    for r in _RECORDINGS:
        if r.covers(t):
            return r
    return None


def lazy_modules(module):
    """Names of torch's lazy modules (they create parameters in forward)."""
    lazy = getattr(torch.nn.modules.lazy, "LazyModuleMixin", ())
    return [n for n, m in module.named_modules() if isinstance(m, lazy)]


def materialize(module, device=None, dtype=None):
    """Gives every meta parameter and buffer of `module` real storage: those with
    elements (the ones this rank keeps) get their values (replayed, or from
    `reset_parameters()` where nothing was recorded); empty ones (released by the
    partition) become empty tensors on the device. With `dtype` (config fp16/bf16:
    Note [Half-precision model] in smp/mixed_precision.py) floating-point values are
    cast to it as soon as their recording is replayed (a model recorded under
    smp.model_creation(dtype=...) replays in that dtype from the start).

    Returns the names of the tensors initialized without a record (for the warning).
    """
    entries = [e for e in state_tensors(module) if e[3].is_meta]
    by_recording = {}
    unrecorded = []
    for e in entries:
        t = e[3]
        if t.numel() == 0:
            continue
        r = _recording_of(t)
        if r is None:
            unrecorded.append(e)
        else:
            by_recording.setdefault(id(r), (r, []))[1].append(e)
    with torch.no_grad():
        for r, es in by_recording.values():
            real = r.replay({_key(t) for _, _, _, t in es})
            for _, _, _, t in es:
                _become(t, _view(real[_key(t)], _Ref(t), r.device_of(t)))
            del real
            if dtype is not None:
                for _, _, _, t in es:
                    if t.is_floating_point() and t.dtype != dtype:
                        t.data = t.data.to(dtype)
        no_reset = _reset_unrecorded(module, unrecorded, device or torch.device("cpu"))
        for _, _, _, t in entries:
            if t.is_meta:  # released: nothing to hold
                r = _recording_of(t)
                dev = r.device_of(t) if r is not None else (device or torch.device("cpu"))
                _become(t, torch.empty(0, dtype=t.dtype, device=dev))
    release_free_heap()  # the replay's scratch (Note [Recording's heap])
    return no_reset


def _become(t, value):
    """Gives the meta tensor `t` the storage of `value`, keeping its Python object (an
    optimizer or a tied module may hold it). `t.data = value` refuses a device change
    from meta, so the two objects' tensors are swapped (torch.utils.swap_tensors). The
    swap exchanges the objects' attributes too; `t` keeps its own (a tensor-parallel
    slice's marks, `_smp_tp_dim` ...)."""
    if isinstance(t, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=t.requires_grad)
    kept = dict(t.__dict__)
    torch.utils.swap_tensors(t, value)
    t.__dict__.update(kept)


def _reset_unrecorded(module, entries, device):
    """A model built under torch.device("meta"): allocates the kept tensors and runs
    `reset_parameters()` of each module holding one. Returns the names left
    uninitialized (no reset_parameters on their module)."""
    if not entries:
        return []
    holders = {}
    for name, m, attr, t in entries:
        _become(t, torch.empty(t.shape, dtype=t.dtype, device=device))
        holders.setdefault(id(m), (m, []))[1].append(name)
    uninitialized = []
    for m, names in holders.values():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            uninitialized.extend(names)
    warnings.warn(
        "smp: the model was built on the meta device without smp.delay_param_"
        "initialization, so its values come from each module's reset_parameters() and do "
        "not equal an eager build" + (
            f"; these have no reset_parameters() and are left uninitialized: "
            f"{uninitialized}" if uninitialized else ""), stacklevel=3)
    return uninitialized


# Note [Traced on real values]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The first step traces the whole model once to partition it. A deferred model has no
# values then, and a trace on meta tensors (shapes only) cannot run a model's
# data-dependent Python: Hugging Face's masking utilities ask `padding_mask.all()`, and
# a meta tensor has no value to answer with. So a recorded model is traced on the real
# microbatch, and each deferred tensor is materialized when an operation first uses
# it, by replaying its recorded init (Note [Replayed init]: the values the rank that
# keeps it will get), and dropped again when the module call in which it was first
# used returns. The trace computes what an eager model computes, and no rank ever
# holds more than the tensors of the module calls in progress. A model built on the
# meta device without the context has no record to replay: it is traced on meta
# tensors, as before.
def fully_recorded(module):
    """Whether every meta tensor of `module` with elements has a recording."""
    return all(_recording_of(t) is not None
               for _, _, _, t in state_tensors(module) if t.is_meta and t.numel() > 0)


def is_recorded(t):
    """Whether `t` is a deferred tensor with a recorded init to replay."""
    return _recording_of(t) is not None


@contextlib.contextmanager
def materialized_on_use(module, dtype=None):
    """Inside, operations on `module`'s recorded meta tensors see their real values
    (Note [Traced on real values]); the Python objects stay meta tensors. With `dtype`
    (config fp16/bf16) floating-point values are seen in it, as the model will hold
    them."""
    # See Note [Private dispatch API].
    from torch.utils._python_dispatch import TorchDispatchMode
    cache = {}       # storage key -> real storage
    frames = [[]]    # per module call in progress: the keys it materialized

    def covered(x):
        return isinstance(x, torch.Tensor) and x.is_meta and _recording_of(x) is not None

    def real(t):
        r = _recording_of(t)
        key = _key(t)
        if key not in cache:
            cache[key] = r.replay({key})[key]
            frames[-1].append(key)
        value = _view(cache[key], _Ref(t), r.device_of(t))
        if dtype is not None and value.is_floating_point() and value.dtype != dtype:
            value = value.to(dtype)
        return value

    class _OnUse(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            return func(*nested.map_leaves(args, real, covered),
                        **nested.map_leaves(kwargs, real, covered))

    def enter(_module, _inputs):
        frames.append([])

    def leave(_module, _inputs, _outputs):
        for key in frames.pop():
            cache.pop(key, None)
    handles = []
    for m in module.modules():
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    try:
        with _OnUse():
            yield
    finally:
        for h in handles:
            h.remove()
        cache.clear()
        release_free_heap()


class CreatedInForward(RuntimeError):
    """A module of a deferred model created a parameter or buffer in forward."""


def check_nothing_created(module, before):
    """After the meta trace: a deferred model must have created every parameter and
    buffer in its constructor; one created in forward has no recorded init (and a
    partition computed without it)."""
    known = {id(t) for _, _, _, t in before}
    new = [name for name, _, _, t in state_tensors(module) if id(t) not in known]
    if new:
        raise CreatedInForward(
            f"smp.delay_param_initialization: the model created {new} in forward (during "
            "the first step's trace); a deferred model must create every parameter and "
            "buffer in its constructor, so that it can be partitioned and initialized "
            "before the first step. Create them in __init__, or build the model eagerly")


def check_optimizer(optimizer):
    """An optimizer built on the meta parameters must not have made state from them
    (Adagrad's `sum`, built in its constructor): that state would stay meta."""
    if optimizer is None:
        return
    opt = getattr(optimizer, "optimizer", optimizer)
    for state in getattr(opt, "state", {}).values():
        for name, v in state.items():
            if isinstance(v, torch.Tensor) and v.is_meta and v.numel() > 0:
                raise RuntimeError(
                    f"smp: optimizer {type(opt).__name__} made its state '{name}' from the "
                    "model's parameters before smp.DistributedModel materialized them "
                    "(smp.delay_param_initialization); create it after the first step, or "
                    "build the model eagerly")


# Note [Memory budget]
# ~~~~~~~~~~~~~~~~~~~~
# A deferred model's partition is allocated only once the plan is known, so smp can
# say before allocating whether a rank's training state fits the memory it may use,
# rather than fail later inside an optimizer step with an allocator's message. The
# need: the kept tensors, a gradient per parameter, and the optimizer's state per
# parameter (two tensors for Adam-like optimizers, one for SGD with momentum or
# RMSprop, two when the optimizer is not known yet; divided over the dp group when it
# is sharded: smp/memory_estimate.py). The limit: RLIMIT_DATA or RLIMIT_AS
# (what the process may still map). Every rank decides, and every rank raises the
# first failing rank's message.
def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def memory_limit():
    """(bytes this process may still allocate, what limits it), or (None, None)."""
    best = (None, None)
    for name, field in (("RLIMIT_DATA", "VmData"), ("RLIMIT_AS", "VmSize")):
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY:
            left = max(0, soft - _status_bytes(field))
            if best[0] is None or left < best[0]:
                best = (left, f"{name} {soft / 2**30:.2f} GiB")
    return best


def training_state_bytes(module, optimizer):
    """(bytes, parameters) of the training state of `module`'s meta tensors with
    elements (those this rank keeps): Note [Memory budget]."""
    states, opt_name = memory_estimate.states_per_param(optimizer)
    shards = optimizer_sharding.shards() if is_initialized() else 1
    factor = memory_estimate.param_memory_factor(optimizer, shards)
    need, params = 0, 0
    for _, _, _, t in state_tensors(module):
        if not t.is_meta or t.numel() == 0:
            continue
        nbytes = t.numel() * t.element_size()
        if isinstance(t, torch.nn.Parameter) and t.requires_grad:
            need += nbytes * factor
            params += t.numel()
        else:
            need += nbytes
    return need, params, states, opt_name


def check_budget(module, optimizer, partitions):
    """Raises on every rank if some rank's partition cannot fit (Note [Memory budget])."""
    need, params, states, opt_name = training_state_bytes(module, optimizer)
    limit, source = memory_limit()
    error = None
    if limit is not None and need > limit:
        what = (f"{opt_name}'s {states} state tensor{'s' if states != 1 else ''}"
                if opt_name else f"{states} optimizer state tensors (the optimizer is not "
                "known yet; Adam's count)")
        error = MemoryError(
            f"smp: this rank's part of the model needs {need / 2**30:.2f} GiB for its "
            f"training state ({params / 1e6:.1f}M parameters with their gradients and "
            f"{what}) but the process may allocate {limit / 2**30:.2f} GiB more ({source}); "
            f"with partitions={partitions} it cannot train. Use more partitions, or a "
            "smaller model")
    if is_initialized() and size() > 1:
        agreement.agree(error, CommGroup.WORLD,
                        agreement.first_error("sizing the model's partition"), own_first=True)
    elif error is not None:
        raise error
