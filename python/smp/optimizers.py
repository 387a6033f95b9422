"""`smp.optimizers`: apex's FusedLamb and FusedNovoGrad, without apex (SMP v1 names).

SMP v1 replaces `apex.optimizers.FusedLAMB` and `FusedNovoGrad` by these, "with the
same functionality": the same constructor arguments and defaults, the same update
(smp_core/optim/: Note [LAMB step] in lamb.cpp, Note [NovoGrad step] in novograd.cpp),
one multi-tensor C++ pass per parameter group, parallel over torch's intra-op threads
and vectorized (Note [Fused optimizer kernels] in optim/detail/multi_tensor.h).
Parameters and gradients may be fp32, fp16 or bf16, on the CPU or any other device:
CPU tensors take the C++ kernels, others (CUDA) the same update in ATen ops, queued on
the device with no host sync (Note [Device-generic steps] in smp_core/optim/
generic.cpp). The math and the state are fp32, and each parameter is written back in
its dtype.

Note [Fused optimizers' state]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
apex counts steps per parameter group and keeps NovoGrad's per-tensor norm average in
the group. Here every piece of state is the parameter's own, as in torch.optim's
optimizers: `step` (an int), `exp_avg` (and LAMB's `exp_avg_sq`) fp32 tensors of the
parameter's shape, NovoGrad's `exp_avg_sq` a 0-d fp32 tensor. So a parameter's update
does not depend on which others are stepped with it, and optimizer-state sharding
(Note [Sharded optimizer state] in smp/optimizer_sharding.py), which steps a share of
each group round by round, computes what one process computes. torch's
`load_state_dict` casts state to the parameter's dtype; here it stays fp32.

Note [LAMB's global norm]
~~~~~~~~~~~~~~~~~~~~~~~~~
LAMB clips by the norm of every gradient the optimizer holds (apex: all its groups).
With partitions > 1 a rank holds one stage's gradients, and with sharded optimizer
state a dp rank keeps only its share: a local norm would differ from one process's,
silently. Once a DistributedModel spans ranks, the norm is the model's global one,
counted as smp.clip_grad_norm_ counts it (grad_norm.global_norm: a tied parameter once,
each sharded gradient on the rank that keeps it, one all_reduce), so every rank calls
step() (every rank does: each steps its own parameters). It is computed once per
step(), over every group; under sharding, where step() runs once per round, once before
the first round (`_smp_whole_step`, Note [Steps in rounds] in optimizer_sharding.py).
"""
import contextlib

import torch

import smp._C as _C
from smp import grad_norm, mixed_precision

__all__ = ["FusedLamb", "FusedNovoGrad"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _pair(name, betas):
    try:
        beta1, beta2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise _C.ConfigError(f"smp: {name} betas={betas!r} is not a pair (beta1, beta2) of "
                               "numbers in [0, 1)") from None
    return beta1, beta2


def _no_amsgrad(name, apex_name, amsgrad):
    if amsgrad:
        raise _C.ConfigError(
            f"smp: {name} amsgrad={amsgrad!r} is not supported (apex's {apex_name} refuses "
            "it too); allowed: amsgrad=False")


class _Fused(torch.optim.Optimizer):
    """What FusedLamb and FusedNovoGrad share: apex's `set_grad_none`, fp32 state
    (Note [Fused optimizers' state]), the lists a group's kernel takes and step(); a
    subclass gives `_group_options(group)`, `_kernel(...)` and `_step_context()`."""

    _name = None  # "FusedLamb", for messages
    _exp_avg_sq_per_tensor = False  # exp_avg_sq: one element per parameter element

    @staticmethod
    def _state_keys():
        return ("exp_avg", "exp_avg_sq")

    def _init_state(self, p, state):
        state["step"] = 0
        state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        shape = () if self._exp_avg_sq_per_tensor else p.shape
        state["exp_avg_sq"] = torch.zeros(shape, dtype=torch.float32, device=p.device)

    def __init__(self, params, defaults, set_grad_none):
        super().__init__(params, defaults)
        self.set_grad_none = bool(set_grad_none)

    def zero_grad(self, set_to_none=None):
        """Clears every gradient: to None when `set_to_none` is true, or, when it is not
        given, as the constructor's `set_grad_none` says (apex's behaviour)."""
        if set_to_none is None:
            set_to_none = self.set_grad_none
        super().zero_grad(set_to_none=set_to_none)

    def _lists(self, group):
        """(params, grads, [state lists...], steps) of the group's parameters that have
        a gradient, their state created and their step counted."""
        params, grads, steps = [], [], []
        states = [[] for _ in self._state_keys()]
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            self._check(p, i)
            g = p.grad
            state = self.state[p]
            if not state:
                self._init_state(p, state)
            state["step"] += 1
            params.append(p.detach())
            grads.append(g.detach())
            steps.append(state["step"])
            for out, key in zip(states, self._state_keys()):
                out.append(state[key])
        return params, grads, states, steps

    def _check(self, p, i):
        """Raises unless parameter `i` of its group (with a gradient) is one the kernels
        step."""
        if p.grad.is_sparse:
            raise RuntimeError(f"smp: {self._name} does not support sparse gradients "
                               f"(parameter {i} of its group), nor does apex's")
        if p.dtype not in _DTYPES:
            raise RuntimeError(f"smp: {self._name}: parameter {i} of its group has dtype "
                               f"{p.dtype}, not one of {{float32, float16, bfloat16}}")

    def _step_context(self):
        """What every group's step needs, computed once per step() (LAMB: the global
        norm)."""
        return None

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every group (Note [LAMB step], Note [NovoGrad step]).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        context = self._step_context()
        for group in self.param_groups:
            options = self._group_options(group)  # validated before any state changes
            params, grads, states, steps = self._lists(group)
            if params:
                self._kernel(params, grads, states, steps, options, context)
        return loss

    def load_state_dict(self, state_dict):
        """torch's, with the state kept in fp32 (torch casts floating-point state to
        each parameter's dtype)."""
        super().load_state_dict(state_dict)
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if torch.is_tensor(value) and value.is_floating_point() and \
                        self.state[p][key].dtype != torch.float32:
                    self.state[p][key] = value.detach().to(p.device, torch.float32).clone()


class FusedLamb(_Fused):
    """LAMB (You et al. 2019, arXiv:1904.00962) as apex's FusedLAMB: Adam's moments,
    an update scaled per tensor by ||p|| / ||update|| (the trust ratio), and the
    gradients first clipped by their global norm (Note [LAMB step] in
    smp_core/optim/lamb.cpp). Cost on CPU: ~1.8 torch's fused AdamW step, about
    AdamW's with torch's clip_grad_norm_ (the same work; bench/mixed_precision.py):
    two passes over each tensor and one over the gradients for their global norm.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        bias_correction: divide the moments by (1 - beta^step).
        betas: decay rates (beta1, beta2) of the moment averages, each in [0, 1).
        eps: added to the update's denominator.
        weight_decay: decoupled decay (adam_w_mode) or L2 penalty.
        amsgrad: not supported (apex refuses it); must be False.
        adam_w_mode: decoupled weight decay (AdamW's) rather than L2 on the gradient.
        grad_averaging: scale the gradient's share of the first moment by (1 - beta1).
        set_grad_none: zero_grad() sets gradients to None (else to zeros).
        max_grad_norm: clip the global gradient norm to this (0 or inf: never). Like
            apex, the constructor's value holds for every group. Under smp it is the
            model's global norm (Note [LAMB's global norm]).
        use_nvlamb: apply the trust ratio to tensors without weight decay too.

    Raises:
        smp.ConfigError: amsgrad=True, or an argument out of its range (named, with
            its value and what is allowed).
        RuntimeError: at step(), a sparse gradient, a parameter that is not an
            fp32/fp16/bf16 tensor.
    """

    _name = "FusedLamb"

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
                 set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False):
        _no_amsgrad(self._name, "FusedLAMB", amsgrad)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        self.adam_w_mode = bool(adam_w_mode)
        self.use_nvlamb = bool(use_nvlamb)
        self._options(defaults, max_grad_norm)  # validates
        super().__init__(params, defaults, set_grad_none)
        self._step_norm = None  # set by _smp_whole_step


    def _options(self, group, max_grad_norm):
        """The group's options for the kernel (validated: smp.ConfigError)."""
        beta1, beta2 = _pair(self._name, group["betas"])
        try:
            return _C.optim.LambOptions(
                lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                bias_correction=bool(group["bias_correction"]),
                grad_averaging=bool(group["grad_averaging"]), adam_w_mode=self.adam_w_mode,
                use_nvlamb=self.use_nvlamb, max_grad_norm=float(max_grad_norm))
        except _C.ConfigError:
            raise
        except (TypeError, ValueError):
            raise _C.ConfigError(
                f"smp: {self._name}: lr={group['lr']!r}, eps={group['eps']!r}, weight_decay="
                f"{group['weight_decay']!r} and max_grad_norm={max_grad_norm!r} must be "
                "numbers") from None

    def _grad_norm(self):
        """The L2 norm of the gradients the step uses, of every group: the model's over
        every rank when they are a spanning model's parameters (Note [LAMB's global
        norm]; collective then), else this rank's. A 0-d tensor on the gradients'
        device (no host sync on a GPU)."""
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    self._check(p, i)
        params = [p for g in self.param_groups for p in g["params"]]
        model = grad_norm.spanning_model()
        params, grad_of = _model_view(self, params, model)
        if model is not None:  # an optimizer of other parameters than the model's: local
            of_model = {id(q) for q in model.local_parameters()}
            of_model.update(id(q) for q in model.module.parameters())
            model = model if any(id(p) in of_model for p in params) else None
        if model is None:
            return _C.optim.sum_of_squares_tensor(
                [g.detach() for g in map(grad_of, params) if g is not None]).sqrt()
        return grad_norm.global_norm(model, params, 2.0, local=_sum_of_squares,
                                     grad_of=grad_of)

    @contextlib.contextmanager
    def _smp_whole_step(self):
        """Note [Steps in rounds] in smp/optimizer_sharding.py: the global norm of the
        share this rank steps, summed over every rank, once before the first round."""
        self._step_norm = self._grad_norm()
        try:
            yield
        finally:
            self._step_norm = None

    def _step_context(self):
        """The global gradient norm, once per step() over every group."""
        return self._step_norm if self._step_norm is not None else self._grad_norm()

    def _group_options(self, group):
        # apex: the constructor's max_grad_norm, for every group.
        return self._options(group, self.defaults["max_grad_norm"])

    @staticmethod
    def _kernel(params, grads, states, steps, options, norm):
        _C.optim.lamb_step(params, grads, *states, steps, norm, options)


def _model_view(optimizer, params, model):
    """(params, grad_of) for the global norm of `params`, the optimizer's groups' now.

    Note [Master weights] in smp/mixed_precision.py: where smp steps fp32 masters of a
    half-precision model, the groups hold each parameter's master inside the step, and
    the parameter itself before a sharded step's rounds. The norm counts the model's
    parameters (tied and sharded ones are known by them) and the gradients the step
    uses: the masters' (fp32, divided by the loss scale)."""
    mp = mixed_precision.of(optimizer)
    if mp is None or not mp.master_weights:
        return params, lambda p: p.grad
    mixed_precision._prepare(optimizer, mp)  # the masters' gradients (once per step)
    owner = {id(m): pid for pid, m in mp.masters.items()}
    by_id = {id(q): q for q in model.local_parameters()} if model is not None else {}
    params = [by_id.get(owner.get(id(p)), p) for p in params]

    def grad_of(p):
        master = mp.masters.get(id(p))
        return master.grad if master is not None else p.grad
    return params, grad_of


def _sum_of_squares(grads, norm_type):
    """grad_norm.global_norm's `local` for L2: the C++ pass (or ATen ops off the CPU),
    a 0-d float64 tensor on the gradients' device."""
    assert norm_type == 2.0
    return _C.optim.sum_of_squares_tensor(grads)


class FusedNovoGrad(_Fused):
    """NovoGrad (Ginsburg et al. 2019, arXiv:1905.11286) as apex's FusedNovoGrad:
    momentum of the gradient normalized per tensor by a running average of its norm
    (Note [NovoGrad step] in smp_core/optim/novograd.cpp).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        bias_correction: divide m by (1 - beta1^step) and the norm average by
            sqrt(1 - beta2^step).
        betas: decay rates (beta1, beta2) of the moment and of the norm average, each in
            [0, 1).
        eps: added to the norm average in the denominator.
        weight_decay: weight decay.
        amsgrad: not supported (apex refuses it); must be False.
        reg_inside_moment: normalize the gradient and add the weight decay before the
            moment (the paper's form) rather than in the update.
        grad_averaging: scale the normalized gradient's share of m by (1 - beta1).
        norm_type: the per-tensor norm: 2 (L2) or 0 (infinity), as apex's.
        init_zero: start the norm average at 0 (else at the first step's norm).
        set_grad_none: zero_grad() sets gradients to None (else to zeros).

    Raises:
        smp.ConfigError: amsgrad=True, norm_type not 2 or 0, or an argument out of its
            range (named, with its value and what is allowed).
        RuntimeError: at step(), a sparse gradient, a parameter that is not an
            fp32/fp16/bf16 tensor.
    """

    _name = "FusedNovoGrad"
    _exp_avg_sq_per_tensor = True  # the norm average v, one number per parameter

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0., amsgrad=False, reg_inside_moment=False, grad_averaging=True,
                 norm_type=2, init_zero=False, set_grad_none=True):
        _no_amsgrad(self._name, "FusedNovoGrad", amsgrad)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        norm_type=norm_type, init_zero=init_zero)
        self.reg_inside_moment = bool(reg_inside_moment)
        self._options(defaults)  # validates
        super().__init__(params, defaults, set_grad_none)


    def _options(self, group):
        """The group's options for the kernel (validated: smp.ConfigError)."""
        beta1, beta2 = _pair(self._name, group["betas"])
        norm_type = group["norm_type"]
        if norm_type not in (0, 2) or isinstance(norm_type, bool):
            raise _C.ConfigError(f"smp: {self._name} norm_type={norm_type!r} is not one of "
                                   "{2 (L2), 0 (infinity)}")
        try:
            return _C.optim.NovoGradOptions(
                lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                bias_correction=bool(group["bias_correction"]),
                grad_averaging=bool(group["grad_averaging"]),
                reg_inside_moment=self.reg_inside_moment, norm_type=int(norm_type),
                init_zero=bool(group["init_zero"]))
        except _C.ConfigError:
            raise
        except (TypeError, ValueError):
            raise _C.ConfigError(
                f"smp: {self._name}: lr={group['lr']!r}, eps={group['eps']!r} and "
                f"weight_decay={group['weight_decay']!r} must be numbers") from None

    def _group_options(self, group):
        return self._options(group)

    @staticmethod
    def _kernel(params, grads, states, steps, options, context):
        _C.optim.novograd_step(params, grads, *states, steps, options)
