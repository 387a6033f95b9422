"""smp.optimizers.FusedLamb and FusedNovoGrad, smp.nn.FusedLayerNorm (SMP v1's
replacements of apex's): the optimizers against references written here from apex's
formulas (apex/optimizers/fused_lamb.py + csrc/multi_tensor_lamb.cu, fused_novograd.py
+ csrc/multi_tensor_novograd.cu), in every option that changes the arithmetic, over 50
steps; fp16 and bf16 parameters; refused arguments; state dicts; and under smp at
pp=2 x dp=2, with and without optimizer-state sharding, against one process training
the plain module on the same global batch (Note [LAMB's global norm]).
"""
import math

import pytest
import torch

import smp
from smp.nn import FusedLayerNorm
from smp.optimizers import FusedLamb, FusedNovoGrad

SHAPES = [(64, 33), (33,), (7,), (130, 600)]  # the last crosses a 65536-element chunk
STEPS = 50


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny tensors: torch's OpenMP threads only spin against the other test processes
    # on a loaded machine (40x slower at 2 threads on 2 busy cores). The kernels'
    # threading is the C++ tests' (tests/cpp/smp_core/optim: the same bits on 1 and 4).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in SHAPES]


def _grads(params, step, scale=0.5, skip=None):
    """Gradients for a step (the same on every call); `skip` leaves one without."""
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)
        p.grad = None if i == skip else grad


# --- references, from apex's formulas ------------------------------------------------

class RefLamb:
    """apex FusedLAMB: global L2 norm over every group's gradients; g /= norm/max when
    above max_grad_norm; Adam moments (beta3 = 1 - beta1 with grad_averaging); update
    m^/(sqrt(v^)+eps) (+ wd p in AdamW mode, else wd p added to g first); per tensor
    p -= lr * ||p||/||u|| * u where wd != 0 or nvlamb (and both norms > 0), else lr."""

    def __init__(self, groups, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0,
                 use_nvlamb=False):
        self.groups = [dict(dict(lr=lr, weight_decay=weight_decay), **g) for g in groups]
        self.o = dict(bias_correction=bias_correction, betas=betas, eps=eps,
                      adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
                      max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb)
        self.state = {}

    def step(self):
        o = self.o
        b1, b2 = o["betas"]
        grads = [p.grad for g in self.groups for p in g["params"] if p.grad is not None]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        mx = o["max_grad_norm"]
        clip = norm / mx if mx > 0 and norm > mx else 1.0
        for group in self.groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state.setdefault(p, dict(step=0, m=torch.zeros(p.shape),
                                                  v=torch.zeros(p.shape)))
                s["step"] += 1
                bc1 = 1 - b1 ** s["step"] if o["bias_correction"] else 1.0
                bc2 = 1 - b2 ** s["step"] if o["bias_correction"] else 1.0
                x = p.detach().float()
                g = p.grad.float() / clip
                if not o["adam_w_mode"]:
                    g = g + wd * x
                s["m"] = s["m"] * b1 + (1 - b1 if o["grad_averaging"] else 1.0) * g
                s["v"] = s["v"] * b2 + (1 - b2) * g * g
                u = (s["m"] / bc1) / ((s["v"] / bc2).sqrt() + o["eps"])
                if o["adam_w_mode"]:
                    u = u + wd * x
                ratio = lr
                if wd != 0 or o["use_nvlamb"]:
                    pn, un = float(x.double().norm()), float(u.double().norm())
                    if pn > 0 and un > 0:
                        ratio = lr * pn / un
                with torch.no_grad():
                    p.copy_(x - ratio * u)  # rounds to the parameter's dtype


class RefNovoGrad:
    """apex FusedNovoGrad: per tensor n = ||g||_2 (or max|g|, norm_type 0); v = n on the
    first step unless init_zero, then v = sqrt(b2 v^2 + (1-b2) n^2) (or b2 v + (1-b2) n);
    denom = v / sqrt(1-b2^t) + eps; moment mode 1 (default): m = b1 m + b3 g,
    p -= lr (m/(1-b1^t) / denom + wd p); reg_inside_moment: m = b1 m + b3 (g/denom +
    wd p), p -= lr m/(1-b1^t)."""

    def __init__(self, groups, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, reg_inside_moment=False, grad_averaging=True, norm_type=2,
                 init_zero=False):
        self.groups = [dict(dict(lr=lr, weight_decay=weight_decay), **g) for g in groups]
        self.o = dict(bias_correction=bias_correction, betas=betas, eps=eps,
                      reg_inside_moment=reg_inside_moment, grad_averaging=grad_averaging,
                      norm_type=norm_type, init_zero=init_zero)
        self.state = {}

    def step(self):
        o = self.o
        b1, b2 = o["betas"]
        b3 = 1 - b1 if o["grad_averaging"] else 1.0
        for group in self.groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state.setdefault(p, dict(step=0, m=torch.zeros(p.shape), v=None))
                s["step"] += 1
                g = p.grad.float()
                # The norm average in fp32 scalars, as apex's kernel keeps it.
                f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
                b2f = f32(b2)
                if o["norm_type"] == 0:
                    n = f32(float(g.double().abs().max()))
                else:
                    n = f32(float(g.double().pow(2).sum()))  # blended as n^2
                if s["step"] == 1:  # the first step's norm, or 0
                    first = n if o["norm_type"] == 0 else n.sqrt()
                    s["v"] = f32(0.0) if o["init_zero"] else first
                s["v"] = (b2f * s["v"] + (1 - b2f) * n if o["norm_type"] == 0
                          else (b2f * s["v"] * s["v"] + (1 - b2f) * n).sqrt())
                bc1 = 1 - b1 ** s["step"] if o["bias_correction"] else 1.0
                bc2 = math.sqrt(1 - b2 ** s["step"]) if o["bias_correction"] else 1.0
                denom = float(s["v"] / f32(bc2) + f32(o["eps"]))
                x = p.detach().float()
                if o["reg_inside_moment"]:
                    s["m"] = b1 * s["m"] + b3 * (g / denom + wd * x)
                    x = x - lr * (s["m"] / bc1)
                else:
                    s["m"] = b1 * s["m"] + b3 * g
                    x = x - lr * ((s["m"] / bc1) / denom + wd * x)
                with torch.no_grad():
                    p.copy_(x)


def _train(make, ref_make, kwargs, dtype=torch.float32, two_groups=False, scale=0.5):
    """50 steps of the fused optimizer and of the reference on equal parameters; the
    parameters of both at the end."""
    ours, theirs = _params(dtype), _params(dtype)
    if two_groups:  # the second group: its own lr and weight decay
        ours_g = [{"params": ours[:2]}, {"params": ours[2:], "lr": 3e-3, "weight_decay": 0.1}]
        theirs_g = [{"params": theirs[:2]}, {"params": theirs[2:], "lr": 3e-3,
                                             "weight_decay": 0.1}]
    else:
        ours_g, theirs_g = [{"params": ours}], [{"params": theirs}]
    opt = make(ours_g, **kwargs)
    ref = ref_make(theirs_g, **kwargs)
    for step in range(STEPS):
        skip = 2 if step % 7 == 3 else None  # a parameter without a gradient now and then
        _grads(ours, step, scale, skip)
        _grads(theirs, step, scale, skip)
        opt.step()
        ref.step()
    return ours, theirs, opt


LAMB_CASES = {
    "defaults (clipping: the norm is ~60 > 1)": {},
    "L2 mode": dict(adam_w_mode=False),
    "no weight decay (lr only, one pass)": dict(weight_decay=0.0),
    "nvlamb without weight decay": dict(weight_decay=0.0, use_nvlamb=True),
    "nvlamb with weight decay": dict(use_nvlamb=True, weight_decay=0.05),
    "no bias correction, no grad averaging": dict(bias_correction=False, grad_averaging=False),
    "max_grad_norm=0: no clipping": dict(max_grad_norm=0.0, lr=1e-2),
    "max_grad_norm above the norm": dict(max_grad_norm=1e4, lr=1e-2),
    "two groups, L2 mode": dict(adam_w_mode=False, two_groups=True),
    "two groups, betas and eps": dict(betas=(0.8, 0.99), eps=1e-4, two_groups=True),
}


@pytest.mark.parametrize("case", LAMB_CASES)
def test_lamb_equals_apex_formulas_fp32(case):
    # 1e-6: the same fp32 operations but norms summed in another order and torch's
    # division by a scalar (a multiplication by its reciprocal), a few ulps at most.
    kwargs = dict(LAMB_CASES[case])
    two = kwargs.pop("two_groups", False)
    ours, theirs, _ = _train(FusedLamb, RefLamb, kwargs, two_groups=two)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert not torch.equal(a, _params()[i]), "the parameters moved"
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"param {i}: {m}")


NOVOGRAD_CASES = {
    "defaults": {},
    "weight decay": dict(weight_decay=0.01),
    "reg_inside_moment": dict(reg_inside_moment=True, weight_decay=0.01),
    "norm_type=0 (infinity)": dict(norm_type=0, weight_decay=0.01),
    "norm_type=0, reg_inside_moment": dict(norm_type=0, reg_inside_moment=True),
    "init_zero": dict(init_zero=True),
    "no bias correction, no grad averaging": dict(bias_correction=False, grad_averaging=False,
                                                  init_zero=True),
    "two groups, betas": dict(betas=(0.95, 0.98), two_groups=True, lr=1e-2),
}


@pytest.mark.parametrize("case", NOVOGRAD_CASES)
def test_novograd_equals_apex_formulas_fp32(case):
    kwargs = dict(NOVOGRAD_CASES[case])
    two = kwargs.pop("two_groups", False)
    ours, theirs, _ = _train(FusedNovoGrad, RefNovoGrad, kwargs, two_groups=two)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"param {i}: {m}")


# Both sides compute each step in fp32 and round the parameter to its dtype once per
# step; their fp32 values differ in the last bits (the norms add in another order),
# which turns a rounding the other way where a value lies that close to a rounding
# boundary. Such an element is then one unit in the last place (ulp) apart, at the
# magnitude it had then, and stays about that far apart (the next steps move both
# copies alike). So: nearly every element bitwise equal, and the others within one
# ulp of the largest magnitude a parameter takes (|p| < 4 here: randn, small steps).
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("opt", ["lamb", "novograd"])
def test_half_precision_parameters_round_once_per_step(dtype, opt):
    make, ref = (FusedLamb, RefLamb) if opt == "lamb" else (FusedNovoGrad, RefNovoGrad)
    ours, theirs, fused = _train(make, ref, dict(lr=1e-2, weight_decay=0.01), dtype=dtype)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.dtype == dtype
        differ = int((a != b).sum())
        assert differ < 1e-3 * a.numel(), f"param {i}: {differ} of {a.numel()} differ"
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=ULP[dtype] * 4,
                                   msg=lambda m: f"param {i}: {m}")
        st = fused.state[a]
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].shape == a.shape
        assert st["exp_avg_sq"].dtype == torch.float32


# --- the device-generic path (Note [Device-generic steps]) against the CPU kernels ------

GENERIC_STEPS = 20


def _kernel_and_generic(make, kwargs, dtype=torch.float32, two_groups=False):
    """GENERIC_STEPS steps of two equal optimizers on equal parameters: one by the CPU
    kernels, one by the ATen ops a GPU runs (SMP_OPTIM_GENERIC=1 for its steps only)."""
    both = []
    for generic in (False, True):
        params = _params(dtype)
        groups = ([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3,
                                             "weight_decay": 0.1}]
                  if two_groups else [{"params": params}])
        both.append((params, make(groups, **kwargs), generic))
    for step in range(GENERIC_STEPS):
        skip = 2 if step % 7 == 3 else None
        for params, opt, generic in both:
            _grads(params, step, skip=skip)
            with pytest.MonkeyPatch.context() as m:
                if generic:
                    m.setenv("SMP_OPTIM_GENERIC", "1")
                opt.step()
    return both


def _assert_same_state(kernel_opt, generic_opt, atol):
    """The same state layout (a state_dict of one loads into the other) and values."""
    a, b = kernel_opt.state_dict()["state"], generic_opt.state_dict()["state"]
    assert sorted(a) == sorted(b)
    for i in a:
        assert a[i]["step"] == b[i]["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = a[i][key], b[i][key]
            assert (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device), (i, key)
            torch.testing.assert_close(x, y, rtol=1e-5, atol=atol,
                                       msg=lambda m: f"state {i} {key}: {m}")


GENERIC_CASES = [(FusedLamb, case, LAMB_CASES[case]) for case in LAMB_CASES] + [
    (FusedNovoGrad, case, NOVOGRAD_CASES[case]) for case in NOVOGRAD_CASES]


@pytest.mark.parametrize("make,case,kwargs", GENERIC_CASES,
                         ids=[f"{m.__name__}: {c}" for m, c, _ in GENERIC_CASES])
def test_generic_path_equals_the_cpu_kernels_fp32(make, case, kwargs):
    # The same fp32 terms in the same order; norms summed in another order and ATen's
    # division by a Scalar (a multiplication by its reciprocal) leave ~1e-7.
    kwargs = dict(kwargs)
    two = kwargs.pop("two_groups", False)
    (kp, kopt, _), (gp, gopt, _) = _kernel_and_generic(make, kwargs, two_groups=two)
    for i, (a, b) in enumerate(zip(kp, gp)):
        assert not torch.equal(b, _params()[i]), "the parameters moved"
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=lambda m: f"param {i}: {m}")
    _assert_same_state(kopt, gopt, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("make", [FusedLamb, FusedNovoGrad])
def test_generic_path_half_precision_within_one_ulp(make, dtype):
    # See ULP: nearly every element bitwise equal, the others one rounding apart. More
    # differ than against the reference (~0.15% of LAMB's, measured): the trust ratio's
    # norms are fp32 sums here, and on the first step, where u = +-1 + wd p, one ratio
    # puts a set of elements at the same distance from a rounding boundary, so its
    # last bit flips them together.
    (kp, kopt, _), (gp, gopt, _) = _kernel_and_generic(
        make, dict(lr=1e-2, weight_decay=0.01), dtype=dtype)
    for i, (a, b) in enumerate(zip(kp, gp)):
        assert b.dtype == dtype
        differ = int((a != b).sum())
        assert differ < 1e-2 * a.numel(), f"param {i}: {differ} of {a.numel()} differ"
        torch.testing.assert_close(b.float(), a.float(), rtol=0, atol=ULP[dtype] * 4,
                                   msg=lambda m: f"param {i}: {m}")
    _assert_same_state(kopt, gopt, atol=1e-5)


def test_generic_path_is_the_one_taken():
    # SMP_OPTIM_GENERIC=1 runs ATen's foreach ops (seen by the profiler), without it the
    # kernel runs none; both with a norm given as a tensor or as a float.
    def ops(generic, norm):
        p, g = [torch.ones(4)], [torch.ones(4)]
        state = [torch.zeros(4)], [torch.zeros(4)]
        with pytest.MonkeyPatch.context() as m, torch.autograd.profiler.profile() as prof:
            if generic:
                m.setenv("SMP_OPTIM_GENERIC", "1")
            smp._C.optim.lamb_step(p, g, *state, [1], norm, smp._C.optim.LambOptions())
        return {e.name for e in prof.function_events}
    for norm in (torch.tensor(2.0), 2.0):
        assert "aten::_foreach_mul_" in ops(True, norm)
        assert not any(name.startswith("aten::_foreach") for name in ops(False, norm))


@pytest.mark.parametrize("make,args,message", [
    (FusedLamb, dict(amsgrad=True), "smp: FusedLamb amsgrad=True is not supported (apex's "
     "FusedLAMB refuses it too); allowed: amsgrad=False"),
    (FusedNovoGrad, dict(amsgrad=True), "smp: FusedNovoGrad amsgrad=True is not supported "
     "(apex's FusedNovoGrad refuses it too); allowed: amsgrad=False"),
    (FusedNovoGrad, dict(norm_type=1), "smp: FusedNovoGrad norm_type=1 is not one of "
     "{2 (L2), 0 (infinity)}"),
    (FusedLamb, dict(betas=(1.0, 0.999)), "smp: FusedLamb betas[0]=1 is not in [0, 1)"),
    (FusedNovoGrad, dict(betas=(0.9, -0.1)), "smp: FusedNovoGrad betas[1]=-0.1 is not in [0, 1)"),
    (FusedLamb, dict(betas=(0.9,)), "smp: FusedLamb betas=(0.9,) is not a pair (beta1, beta2) "
     "of numbers in [0, 1)"),
    (FusedLamb, dict(lr=-1.0), "smp: FusedLamb lr=-1 is not a number >= 0"),
    (FusedLamb, dict(eps=-1e-6), "smp: FusedLamb eps=-1e-06 is not a number >= 0"),
    (FusedNovoGrad, dict(weight_decay=-0.5), "smp: FusedNovoGrad weight_decay=-0.5 is not a "
     "number >= 0"),
    (FusedLamb, dict(max_grad_norm=-1.0), "smp: FusedLamb max_grad_norm=-1 is not a number "
     ">= 0 (0 or inf: no clipping)"),
    (FusedLamb, dict(lr="fast"), "smp: FusedLamb: lr='fast', eps=1e-06, weight_decay=0.01 and "
     "max_grad_norm=1.0 must be numbers"),
])
def test_bad_arguments_are_refused_by_name(make, args, message):
    with pytest.raises(smp.ConfigError) as e:
        make(_params(), **args)
    assert str(e.value) == message
    assert isinstance(e.value, ValueError)


def test_what_the_step_refuses_is_named():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"smp: FusedLamb: parameter 0 of its group has "
                       r"dtype torch.float64, not one of \{float32, float16, bfloat16\}"):
        FusedLamb([p]).step()
    emb = torch.nn.Embedding(5, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="smp: FusedNovoGrad does not support sparse "
                       r"gradients \(parameter 0 of its group\), nor does apex's"):
        FusedNovoGrad(emb.parameters()).step()
    opt = FusedLamb(_params())
    opt.param_groups[0]["lr"] = -0.1  # a scheduler gone wrong: refused at the step
    with pytest.raises(smp.ConfigError, match="lr=-0.1 is not a number >= 0"):
        opt.step()


@pytest.mark.parametrize("make", [FusedLamb, FusedNovoGrad])
def test_state_dict_resumes_bitwise_and_stays_fp32(make, tmp_path):
    # torch's load_state_dict casts state to each parameter's dtype; ours stays fp32.
    a, b = _params(torch.float16), _params(torch.float16)
    opt_a = make(a, lr=1e-2)
    opt_b = make(b, lr=1e-2)
    for step in range(3):
        _grads(a, step), _grads(b, step)
        opt_a.step(), opt_b.step()
    torch.save(opt_b.state_dict(), tmp_path / "opt.pt")
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    opt_c = make(c, lr=1e-2)
    opt_c.load_state_dict(torch.load(tmp_path / "opt.pt"))
    assert all(t.dtype == torch.float32 for s in opt_c.state.values() for t in s.values()
               if torch.is_tensor(t))
    assert [s["step"] for s in opt_c.state.values()] == [3] * len(c)
    for step in range(3, 6):
        _grads(a, step), _grads(c, step)
        opt_a.step(), opt_c.step()
    for x, y in zip(a, c):
        assert torch.equal(x, y)


def test_set_grad_none():
    p = _params()
    opt = FusedLamb(p, set_grad_none=False)
    _grads(p, 0)
    opt.zero_grad()
    assert all(torch.count_nonzero(q.grad) == 0 for q in p)
    FusedLamb(p).zero_grad()  # apex's default: None
    assert all(q.grad is None for q in p)


def test_smdistributed_names():
    import importlib
    shim = importlib.import_module("smdistributed.modelparallel.torch")
    nn_mod = importlib.import_module("smdistributed.modelparallel.torch.nn")
    from smdistributed.modelparallel.torch.optimizers import FusedLamb as Lamb
    from smdistributed.modelparallel.torch.optimizers import FusedNovoGrad as NovoGrad
    assert shim is smp and nn_mod is smp.nn
    assert nn_mod.FusedLayerNorm is FusedLayerNorm
    assert (Lamb, NovoGrad) == (FusedLamb, FusedNovoGrad)


# --- FusedLayerNorm --------------------------------------------------------------------

@pytest.mark.parametrize("shape,affine", [(8, True), ((4, 8), True), ((4, 8), False)])
def test_fused_layer_norm_is_layer_norm(shape, affine):
    torch.manual_seed(0)
    ours = FusedLayerNorm(shape, eps=1e-5, elementwise_affine=affine)
    theirs = torch.nn.LayerNorm(shape, eps=1e-5, elementwise_affine=affine)
    if affine:  # not the initial ones and zeros
        with torch.no_grad():
            ours.weight.normal_(), ours.bias.normal_()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 5, 4, 8, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    out, ref = ours(x), theirs(y)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g), ref.backward(g)
    assert torch.equal(x.grad, y.grad)
    if affine:
        assert torch.equal(ours.weight.grad, theirs.weight.grad)
        assert torch.equal(ours.bias.grad, theirs.bias.grad)
    back = FusedLayerNorm(shape, elementwise_affine=affine)
    back.load_state_dict(theirs.state_dict())  # and back
    assert list(back.state_dict()) == list(theirs.state_dict()) == (
        ["weight", "bias"] if affine else [])
    assert repr(ours) == repr(theirs).replace("LayerNorm", "FusedLayerNorm")


def test_fused_layer_norm_under_autocast_runs_as_layer_norm():
    ours, theirs = FusedLayerNorm(16), torch.nn.LayerNorm(16)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = ours(x.bfloat16()), theirs(x.bfloat16())
    assert a.dtype == b.dtype
    assert torch.equal(a, b)


# --- under smp: pp=2 x dp=2, with and without sharding, against one process -----------

# The scripts' start: smp over opts["cfg"], a net whose first weight the last stage
# holds too (tied), and `batches(n)`, each rank's share of n equal global batches.
PRELUDE = r"""
import copy, json, math, sys
import torch, torch.nn as nn
import smp
from smp.optimizers import FusedLamb, FusedNovoGrad

opts = json.loads(sys.argv[1])
smp.init(opts["cfg"])
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 64), nn.ReLU(),
                    nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 8))
net[6].weight = net[0].weight  # tied: the first and the last stage hold it


def batches(n):
    per = 16 // smp.dp_size()
    lo = smp.dp_rank() * per
    for step in range(n):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g)
        yield step, x, y, x[lo:lo + per], y[lo:lo + per]


def make_train(model):
    @smp.step
    def train(x, y):
        loss = nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss
    return train
"""

TRAIN = PRELUDE + r"""
ref = copy.deepcopy(net)  # the plain module, one process, the whole batch
make, kw = {"lamb": FusedLamb, "novograd": FusedNovoGrad}[opts["opt"]], opts["kw"]
model = smp.DistributedModel(net, bucket_cap_mb=opts.get("cap_mb", 25))
opt = smp.DistributedOptimizer(make(net.parameters(), **kw))
ref_opt = make(ref.parameters(), **kw)
train = make_train(model)
for step, x, y, xs, ys in batches(4):
    train(xs, ys)
    opt.step()
    opt.zero_grad()
    nn.functional.mse_loss(ref(x), y).backward()
    if opts["opt"] == "lamb":  # the clipping clips: a rank's share alone would differ
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.parameters()))
        assert norm > kw["max_grad_norm"], norm
    ref_opt.step()
    ref_opt.zero_grad()

full, full_opt = model.state_dict(), opt.state_dict()  # collectives: every rank
if smp.rank() == 0:
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
    want = ref_opt.state_dict()["state"]
    assert sorted(full_opt["state"]) == sorted(want), (sorted(full_opt["state"]), sorted(want))
    for i, s in want.items():
        assert full_opt["state"][i]["step"] == s["step"] == 4
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full_opt["state"][i][key], s[key], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"state {i} {key}: {m}")
    print("EQUAL")
smp.shutdown()
"""


def _pp2_dp2_opts(opt, shard):
    cfg = {"partitions": 2, "microbatches": 2, "ddp": True, "shard_optimizer_state": shard}
    kw = (dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.05) if opt == "lamb"
          else dict(lr=1e-2, weight_decay=0.01, reg_inside_moment=True))
    extra = {"cap_mb": 1 / 128} if shard else {}
    return dict(cfg=cfg, opt=opt, kw=kw, **extra)


_PP2_DP2_CASES = [_pp2_dp2_opts(o, s) for o, s in [("lamb", False), ("lamb", True),
                                                    ("novograd", True)]]
_FP16_NORM_CASES = [dict(cfg={"partitions": 2, "microbatches": 2, "ddp": True, "fp16": True,
                              "shard_optimizer_state": shard}) for shard in (False, True)]


@pytest.fixture(scope="module")
def fused_jobs(tmp_path_factory):
    """`fused_jobs(script, cases, opts)`: each rank's output of `script` run with `opts`,
    one of `cases`. A script's cases run in one pp=2 x dp=2 job (Note [One job for many
    cases] in conftest.py), made on first use; each case inits smp with its own config."""
    import json
    from conftest import run_cases
    made = {}

    def get(script, cases, opts):
        if script not in made:
            made[script] = run_cases(script, [(json.dumps(c),) for c in cases], 4,
                                     tmp_path_factory.mktemp("fused"), timeout_per_case=120)
        return made[script].stdout(cases.index(opts))
    return get


@pytest.mark.parametrize("opt,shard", [("lamb", False), ("lamb", True), ("novograd", True)],
                         ids=["lamb", "lamb-sharded", "novograd-sharded"])
def test_pp2_dp2_equals_one_process(fused_jobs, opt, shard):
    # LAMB clips by the global norm (max_grad_norm below it every step): every stage's
    # gradients, the tied weight once, each sharded gradient on the rank keeping it.
    # Sharded, in buckets of 8 KiB: each rank's share is stepped in several rounds, the
    # norm computed once before them (Note [Steps in rounds]).
    out = fused_jobs(TRAIN, _PP2_DP2_CASES, _pp2_dp2_opts(opt, shard))
    assert "EQUAL" in out[0], out[0]


FP16_NORM = PRELUDE + r"""
model = smp.DistributedModel(net, bucket_cap_mb=1 / 128)
opt = smp.DistributedOptimizer(FusedLamb(net.parameters(), lr=1e-2, max_grad_norm=0.05),
                               static_loss_scale=8.0)  # the fp16 gradients are 8x the masters'
norms = []
own = opt._grad_norm
opt._grad_norm = lambda: norms.append(own()) or norms[-1]
train = make_train(model)
for step, x, y, xs, ys in batches(3):
    train(xs, ys)
    want = float(opt.clip_master_grads(float("inf")))  # smp's global norm of the masters
    opt.step()
    assert len(norms) == step + 1, norms
    assert abs(norms[-1] - want) <= 1e-6 * want, (norms[-1], want)
assert all(p.dtype == torch.float16 for p in model.local_parameters())
print("EQUAL")
smp.shutdown()
"""


@pytest.mark.parametrize("shard", [False, True], ids=["pp2xdp2", "pp2xdp2-sharded"])
def test_lamb_norm_under_fp16_masters_is_the_global_norm_of_the_masters(fused_jobs, shard):
    # Note [Master weights] in smp/mixed_precision.py: the step sees fp32 masters in the
    # groups (or, before a sharded step's rounds, the fp16 parameters); LAMB counts the
    # model's parameters (the tied weight once) with the masters' gradients, the norm
    # optimizer.clip_master_grads computes.
    out = fused_jobs(FP16_NORM, _FP16_NORM_CASES, _FP16_NORM_CASES[shard])
    assert "EQUAL" in out[0], out[0]
