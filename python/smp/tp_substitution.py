"""Tensor parallelism's substitution (SMP v1.10): `smp.tp_register`,
`smp.tp_register_with_module`, `smp.tensor_parallelism`, `smp.set_tensor_parallelism`.

Note [Substitution]
~~~~~~~~~~~~~~~~~~~
A module class is *registered* with a distributed module (`smp.nn.Distributed*`) and
three optional hooks. Registering wraps the class's `__init__` so that each instance
records the arguments it was built with. A module is *tp-enabled* when it was created
inside an enabled `smp.tensor_parallelism` context (innermost wins; each module records
the context open when torch's `nn.Module.__init__` ran, as `smp.partition` records its
index) or when `smp.set_tensor_parallelism` marked it since.

`smp.DistributedModel(module)` substitutes before anything else looks at the model
(its parameters, tracing, partitioning): walking the tree from the root, the first
tp-enabled module of a registered class (exact class) on each path is replaced, and
its subtree is not visited (outermost only). For it:
- `init_hook(*args, **kwargs)` (the recorded arguments; absent: as they are) gives
  the distributed module's `(args, kwargs)`; keyword arguments of the module's
  context (or of set_tensor_parallelism) that name a parameter of the distributed
  module's `__init__` override them; the others (speed hints such as `fused_softmax`
  that this module does not take) are ignored.
- It is skipped, with one log line naming it and why, when its hyperparameters do not
  divide by tp (heads, intermediate size, embedding width, a row-split input width),
  when one of its parameters is also held by a module outside it (shared weights),
  or when its init_hook raises `NotDistributable`.
- The distributed module replaces it in its parent (every place the module object
  appears; the root replaces `DistributedModel.module`). `forward_hook(*args,
  **kwargs) -> (args, kwargs)` translates each call's arguments and
  `return_hook(output)` the result: torch forward pre-/post-hooks on the new module,
  so they run wherever the module runs (on its pp owner; inside checkpointing).
- Values: a built-in Hugging Face registration gives the new module the original
  module's current weights (translated to smp's names, each tp rank taking its slice
  of a distributed parameter, `p._smp_tp_dim`), built with the random generator
  saved and restored, so the substituted model equals the plain one built from the
  same seed and the generator is where the plain build left it. A user registration
  keeps the distributed module's own initialisation (SMP's). A module built under
  `smp.delay_param_initialization` has no values to copy: the distributed module is
  built deferred too (its own init, replayed on materialization).

Substitution runs when tp > 1 or when a module was enabled explicitly (SMP distributes
with tp = 1 when asked: `use_distributed_transformer`); a job that enables nothing is
unchanged whatever tp is.
"""
import contextlib
import functools
import inspect
import sys

import torch

import smp._C as _C
from smp import deferred_init, log, process_state
from smp.ranks import tp_rank, tp_size

__all__ = ["tp_register", "tp_register_with_module", "tensor_parallelism",
           "set_tensor_parallelism", "model_creation", "NotDistributable"]

_ATTR = "_smp_tp_config"      # (enabled, kwargs) a module was created under / set to
_ARGS = "_smp_tp_init_args"   # (args, kwargs) of a registered class's __init__

_stack = []       # open tensor_parallelism contexts: (enabled, merged kwargs), innermost last
_registry = {}    # module class -> _Registration


class NotDistributable(Exception):
    """Raised by an init hook: this instance has no distributed equivalent (the
    message says why); substitution skips it with a log line."""


class _Registration:
    __slots__ = ("module_cls", "dist_module", "init_hook", "forward_hook", "return_hook",
                 "values", "recover_args", "translations", "builtin")

    def __init__(self, module_cls, dist_module, init_hook, forward_hook, return_hook,
                 values=None, recover_args=None, translations=None, builtin=False):
        self.module_cls, self.dist_module = module_cls, dist_module
        self.init_hook, self.forward_hook, self.return_hook = init_hook, forward_hook, return_hook
        self.values = values              # module -> full smp state dict (built-ins)
        self.recover_args = recover_args  # module -> (args, kwargs) when none recorded
        self.translations = translations  # module -> (smp_to_hf, hf_to_smp) for HF's save
        self.builtin = builtin


# --- recording --------------------------------------------------------------------------

def _install_module_hook():
    init = torch.nn.Module.__init__
    if getattr(init, "_smp_tp_wrapped", False):
        return

    @functools.wraps(init)  # (keeps smp.partition's mark: it wraps once)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if _stack:
            object.__setattr__(self, _ATTR, _stack[-1])
    wrapped._smp_tp_wrapped = True
    torch.nn.Module.__init__ = wrapped


_install_module_hook()


def _record_init_args(cls):
    """Wraps `cls.__init__` (once) so that an instance of exactly `cls` keeps the
    arguments it was built with."""
    orig = cls.__init__
    if getattr(orig, "_smp_tp_records", None) is cls:
        return

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        if type(self) is cls and _ARGS not in self.__dict__:
            object.__setattr__(self, _ARGS, (args, kwargs))
        orig(self, *args, **kwargs)
    __init__._smp_tp_records = cls
    cls.__init__ = __init__


# --- the public API ---------------------------------------------------------------------

def _check_dist_module(where, dist_module):
    base = _distributed_base()
    ok = isinstance(dist_module, type) and issubclass(dist_module, base or torch.nn.Module)
    if not ok:
        raise TypeError(f"smp.{where}: dist_module={dist_module!r} is not a subclass of "
                        f"{'smp.nn.DistributedModule' if base else 'torch.nn.Module'}")


def _distributed_base():
    nn = sys.modules.get("smp.nn")
    return getattr(nn, "DistributedModule", None) if nn is not None else None


def _check_hooks(where, **hooks):
    for name, hook in hooks.items():
        if hook is not None and not callable(hook):
            raise TypeError(f"smp.{where}: {name}={hook!r} is not callable (allowed: a "
                            "callable or None)")


def tp_register_with_module(module_cls, dist_module, init_hook=None, forward_hook=None,
                            return_hook=None):
    """Registers `dist_module` (an `smp.nn.DistributedModule` subclass) as the
    distributed version of `module_cls` (SMP v1.10). See Note [Substitution].

    Args:
        module_cls: the module class to distribute (its exact instances).
        dist_module: the distributed module class that replaces it.
        init_hook: `init_hook(*init_args, **init_kwargs) -> (args, kwargs)` for
            `dist_module(*args, **kwargs)`; its signature is `module_cls.__init__`'s
            without self. None: the arguments as they are.
        forward_hook: `forward_hook(*args, **kwargs) -> (args, kwargs)` of each call,
            signature `module_cls.forward`'s without self. None: as they are.
        return_hook: `return_hook(output)`: the distributed module's output as
            `module_cls.forward` returns it. None: as it is.

    Raises:
        TypeError: module_cls is not an nn.Module class, dist_module is not a
            distributed module class, or a hook is not callable.
    """
    if not (isinstance(module_cls, type) and issubclass(module_cls, torch.nn.Module)):
        raise TypeError(f"smp.tp_register_with_module: module_cls={module_cls!r} is not a "
                        "torch.nn.Module subclass")
    _check_dist_module("tp_register_with_module", dist_module)
    _check_hooks("tp_register_with_module", init_hook=init_hook, forward_hook=forward_hook,
                 return_hook=return_hook)
    _register(_Registration(module_cls, dist_module, init_hook, forward_hook, return_hook))


def tp_register(dist_module, init_hook=None, forward_hook=None, return_hook=None):
    """Class decorator: registers `dist_module` as the distributed version of the class
    it decorates (SMP v1.10; arguments as `smp.tp_register_with_module`)."""
    _check_dist_module("tp_register", dist_module)
    _check_hooks("tp_register", init_hook=init_hook, forward_hook=forward_hook,
                 return_hook=return_hook)

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TypeError(f"smp.tp_register: decorates {cls!r}, not a torch.nn.Module "
                            "subclass")
        _register(_Registration(cls, dist_module, init_hook, forward_hook, return_hook))
        return cls
    return decorate


def _register(reg):
    _record_init_args(reg.module_cls)
    _registry[reg.module_cls] = reg


def registration(module_cls):
    """The registration of exactly `module_cls`, or None."""
    return _registry.get(module_cls)


@contextlib.contextmanager
def tensor_parallelism(enabled=True, **kwargs):
    """Enables (or disables) tensor parallelism for the registered modules created
    inside (SMP v1.10). The innermost context decides `enabled`; keyword arguments
    accumulate (an inner one overrides an outer one of the same name) and override the
    init_hook's arguments of the same name of each distributed module they reach
    (ignored where its `__init__` has no such parameter). Substitution itself happens
    at `smp.DistributedModel(...)` (Note [Substitution]).

    Raises:
        ValueError: enabled is not a bool.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"smp.tensor_parallelism: enabled={enabled!r} is not one of "
                         "{True, False}")
    register_builtins()
    merged = dict(_stack[-1][1]) if _stack else {}
    merged.update(kwargs)
    _stack.append((enabled, merged))
    try:
        yield
    finally:
        _stack.pop()


_context = tensor_parallelism  # (model_creation's argument has the context's name)


def set_tensor_parallelism(module, enabled=True, **kwargs):
    """Enables (or disables) tensor parallelism for `module`'s whole subtree, after its
    creation and before `smp.DistributedModel(...)` (SMP v1.10): when enabling, the
    outermost registered modules in it are distributed; `kwargs` as
    `smp.tensor_parallelism`'s. A later call on a submodule overrides this one there.

    Raises:
        TypeError: module is not an nn.Module. ValueError: enabled is not a bool.
        RuntimeError: the model is already wrapped by smp.DistributedModel.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"smp.set_tensor_parallelism: module={module!r} is not a "
                        "torch.nn.Module")
    if not isinstance(enabled, bool):
        raise ValueError(f"smp.set_tensor_parallelism: enabled={enabled!r} is not one of "
                         "{True, False}")
    model = getattr(process_state.state, "model", None)
    if model is not None and any(m is module for m in model.get_module().modules()):
        raise RuntimeError("smp.set_tensor_parallelism: the module is already part of an "
                           "smp.DistributedModel, whose substitution has run; call it before "
                           "wrapping the model")
    register_builtins()
    config = (enabled, dict(kwargs))
    for m in module.modules():
        object.__setattr__(m, _ATTR, config)


def tp_config(module):
    """(enabled, kwargs) of `module`, or None where nothing enabled or disabled it."""
    return module.__dict__.get(_ATTR)


# --- built-in registrations (Hugging Face) ----------------------------------------------

_PROVIDERS = []  # the built-in registrations' makers (smp.nn.huggingface adds its own)


def add_builtin_provider(provider):
    """`provider(registry, register, Registration)` registers built-in classes whose
    library is loaded (it must import nothing new) unless `registry` has them already;
    called before each substitution and on entering a context."""
    if provider not in _PROVIDERS:
        _PROVIDERS.append(provider)


def register_builtins():
    """The built-in registrations (Hugging Face GPT-2 and BERT, smp.nn.huggingface) of
    the libraries loaded now; needs the distributed modules (smp.nn)."""
    if _distributed_base() is None:
        return
    for provider in _PROVIDERS:
        provider(_registry, _register, _Registration)


# --- substitution -----------------------------------------------------------------------

_INDIVISIBLE = ("num_attention_heads", "intermediate_size", "embedding_dim", "in_features")


def _indivisible(dist_module, bound, tp):
    """Why the bound arguments cannot be cut tp ways, or None."""
    names = list(_INDIVISIBLE)
    if "vocab_size" in bound or "num_positions" in bound:
        names.append("hidden_size")  # the LM head's embeddings are cut along it
    bad = [f"{n}={bound[n]}" for n in names
           if isinstance(bound.get(n), int) and not isinstance(bound.get(n), bool)
           and bound[n] % tp != 0]
    return f"{', '.join(bad)} not divisible by tensor_parallel_degree {tp}" if bad else None


def _bind(reg, args, kwargs, context_kwargs):
    """(args, kwargs, all bound values) for reg.dist_module, with the context's keyword
    arguments that name its parameters overriding."""
    sig = inspect.signature(reg.dist_module.__init__)
    try:
        bound = sig.bind(None, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"smp: the init_hook of {reg.module_cls.__name__} gave arguments "
                        f"that {reg.dist_module.__name__} does not take: {e}") from None
    for name, value in context_kwargs.items():
        p = sig.parameters.get(name)
        if p is not None and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name != "self":
            bound.arguments[name] = value
    args_out, kwargs_out = bound.args[1:], dict(bound.kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    values.pop("self", None)
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            values.update(values.pop(p.name, {}))
    return args_out, kwargs_out, values


class _ForwardPre:
    """The forward_hook as a torch forward pre-hook (picklable when the hook is)."""

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, module, args, kwargs):
        a, k = self.hook(*args, **kwargs)
        return tuple(a), dict(k)


class _Return:
    """The return_hook as a torch forward hook."""

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, module, args, output):
        return self.hook(output)


def _float_like(module):
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point():
            return t
    return None


def enabled_anywhere(root):
    return any((tp_config(m) or (False,))[0] for m in root.modules())


def substitute(root):
    """Note [Substitution]: `root` with its outermost tp-enabled registered modules
    replaced by their distributed versions (the root itself may be replaced). Called by
    smp.DistributedModel before anything else reads the model."""
    if not enabled_anywhere(root):
        return root
    register_builtins()
    if not _registry:
        return root
    tp = tp_size()
    owners = {}
    for m in root.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(id(m))
    logger = log.get_logger("tp")
    done = {}  # id(original) -> replacement (a module found under several names)

    def visit(module, path):
        if id(module) in done:
            return done[id(module)]
        reg = _registry.get(type(module))
        config = tp_config(module)
        if reg is not None and config is not None and config[0]:
            why = _skip_reason(module, reg, config[1], tp, owners)
            if isinstance(why, str):
                logger.info("smp: tensor parallelism: %s (%s) is not distributed: %s",
                            path or "the model", type(module).__name__, why)
            else:
                new = _build(module, reg, *why)
                done[id(module)] = new
                logger.info("smp: tensor parallelism: %s (%s) -> %s", path or "the model",
                            type(module).__name__, type(new).__name__)
                return new
        done[id(module)] = module
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            new = visit(child, f"{path}.{name}" if path else name)
            if new is not child:
                module._modules[name] = new
        return module
    return visit(root, "")


def _skip_reason(module, reg, context_kwargs, tp, owners):
    """A string saying why `module` stays as it is, or (args, kwargs) of its
    distributed module."""
    recorded = module.__dict__.get(_ARGS)
    if recorded is None and reg.recover_args is not None:
        recorded = reg.recover_args(module)
    if recorded is None:
        return ("its __init__ arguments were not recorded (it was created before "
                f"{reg.module_cls.__name__} was registered)")
    args, kwargs = recorded
    try:
        if reg.init_hook is not None:
            got = reg.init_hook(*args, **kwargs)
            if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict)):
                raise TypeError(f"smp: the init_hook of {reg.module_cls.__name__} returned "
                                f"{got!r}, not an (args, kwargs) tuple")
            args, kwargs = tuple(got[0]), got[1]
    except NotDistributable as e:
        return str(e)
    args, kwargs, values = _bind(reg, args, kwargs, context_kwargs)
    why = _indivisible(reg.dist_module, values, tp)
    if why:
        return why
    inside = {id(m) for m in module.modules()}
    for name, p in module.named_parameters():
        if not owners.get(id(p), set()) <= inside:
            return f"its parameter {name} is shared with a module outside it"
    return args, kwargs


def _build(module, reg, args, kwargs):
    like = _float_like(module)
    dtype = like.dtype if like is not None else torch.get_default_dtype()
    device = like.device if like is not None and not like.is_meta else None
    deferred = deferred_init.is_deferred(module)
    # A built-in's values may be None: the module was never initialized (the caller
    # skipped its library's init), so the distributed module keeps its own.
    values = reg.values(module) if reg.values is not None and not deferred else None
    copy = values is not None
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if deferred:
            with deferred_init.delay_param_initialization():
                new = reg.dist_module(*args, **kwargs)
        elif copy:
            devices = ([torch.cuda.current_device()] if torch.cuda.is_available()
                       and torch.cuda.is_initialized() else [])
            with torch.random.fork_rng(devices=devices):
                new = reg.dist_module(*args, **kwargs)
        else:
            new = reg.dist_module(*args, **kwargs)
    finally:
        torch.set_default_dtype(before)
    if copy:
        load_full_state(new, values)
    if device is not None:
        new.to(device)
    if reg.forward_hook is not None:
        new.register_forward_pre_hook(_ForwardPre(reg.forward_hook), with_kwargs=True)
    if reg.return_hook is not None:
        new.register_forward_hook(_Return(reg.return_hook))
    if tp_config(module) is not None:
        object.__setattr__(new, _ATTR, tp_config(module))
    new.train(module.training)
    if reg.translations is not None:
        _add_translations(reg.translations(module))
    return new


class Translation:
    """One direction of a state-dict translation, named by `key` (its model kind)."""

    def __init__(self, key, fn, **kwargs):
        self.key, self.fn, self.kwargs = key, fn, kwargs

    def __call__(self, state_dict):
        return self.fn(state_dict, **self.kwargs)


def _add_translations(pair):
    """SMP 1.10's state.module_manager.translate_functions, (smp_to_hf, hf_to_smp)
    pairs (Hugging Face's save_pretrained translates with them), each kind once."""
    fns = process_state.state.module_manager.translate_functions
    key = getattr(pair[0], "key", None)
    if key is not None and any(getattr(f, "key", None) == key for f, _ in fns):
        return
    fns.append(pair)


def load_full_state(dist, full):
    """Loads the full (unsliced) tensors `full`, by the distributed module's names, into
    `dist`: a distributed parameter (`p._smp_tp_dim`) takes this tp rank's contiguous
    slice along its dim (`_smp_tp_slice`), every other tensor the whole. Every parameter must be given;
    a buffer not given keeps its value."""
    missing = [n for n, _ in dist.named_parameters() if n not in full]
    if missing:
        raise KeyError(f"smp: no value for {missing} of {type(dist).__name__}")
    rank = tp_rank()
    with torch.no_grad():
        for name, t in list(dist.named_parameters()) + list(dist.named_buffers()):
            if name not in full:
                continue
            src = full[name]
            dim = getattr(t, "_smp_tp_dim", None)
            if dim is not None:
                whole = tuple(getattr(t, "_smp_tp_full_shape", src.shape))
                if tuple(src.shape) != whole:
                    raise ValueError(f"smp: {name} of {type(dist).__name__} is {whole} whole, "
                                     f"given {tuple(src.shape)}")
                n = t.shape[dim]
                start, n = getattr(t, "_smp_tp_slice", (rank * n, n))
                src = src.narrow(dim, start, n)
            if tuple(src.shape) != tuple(t.shape):
                raise ValueError(f"smp: {name} of {type(dist).__name__} is "
                                 f"{tuple(t.shape)}, given {tuple(src.shape)}")
            t.copy_(src)


@contextlib.contextmanager
def model_creation(tensor_parallelism=False, dtype=None, distribute_embedding=False,
                   **tensor_parallel_config):
    """SMP v1.10's context for building the model: with `dtype` (torch.float16,
    torch.bfloat16 or torch.float32) the floating-point parameters and buffers of the
    modules built inside are created in it (torch's default dtype inside the block;
    Note [Half-precision model] in smp/mixed_precision.py); with `tensor_parallelism`
    the block is an enabled `smp.tensor_parallelism` context (Note [Substitution]).

    Args:
        tensor_parallelism: enable tensor parallelism for the registered modules built
            inside (False: no context is opened, an outer one still applies).
        dtype: the dtype of the modules built inside, or None (as they are).
        distribute_embedding, **tensor_parallel_config: the context's keyword
            arguments (unused without tensor_parallelism). Each reaches a distributed
            module whose __init__ has a parameter of its name and is ignored elsewhere:
            SMP's speed and precision hints `attention_in_fp32`,
            `query_key_layer_scaling`, `fused_softmax`, `fused_dropout` and
            `fused_bias_gelu` are accepted for SMP's scripts and only reach a module
            that takes them.

    Raises:
        smp.ConfigError: tensor_parallelism is not a bool, or dtype is not allowed.
    """
    if not isinstance(tensor_parallelism, bool):
        raise _C.ConfigError(f"smp.model_creation: tensor_parallelism={tensor_parallelism!r} "
                             "is not one of {True, False}")
    allowed = (None, torch.float16, torch.bfloat16, torch.float32)
    if dtype not in allowed:
        raise _C.ConfigError(f"smp.model_creation: dtype={dtype!r} is not allowed (allowed: "
                             "None, torch.float16, torch.bfloat16, torch.float32)")
    with contextlib.ExitStack() as stack:
        if tensor_parallelism:
            stack.enter_context(_context(True, distribute_embedding=distribute_embedding,
                                         **tensor_parallel_config))
        st = process_state.state
        if st.initialized and getattr(st.cfg, "delayed_parameter_initialization", False):
            # SMP's config key: the block is an smp.delay_param_initialization() block.
            stack.enter_context(deferred_init.delay_param_initialization(True))
        if dtype is not None:
            before = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            stack.callback(torch.set_default_dtype, before)
        yield
