"""smp.optimizers.FusedLamb and FusedNovoGrad on CUDA parameters (the device-generic
path, Note [Device-generic steps] in smp_core/optim/generic.cpp) against the CPU kernels
on the same data: 20 steps in the options that change the arithmetic, fp32, fp16 and
bf16; and no host sync inside a step (torch's sync debug mode)."""
import pytest
import torch

from smp.optimizers import FusedLamb, FusedNovoGrad

SHAPES = [(64, 33), (33,), (7,), (130, 600)]  # the last crosses a 65536-element chunk
STEPS = 20
CASES = [
    (FusedLamb, {}),  # clipping: the norm is ~60 > 1
    (FusedLamb, dict(adam_w_mode=False)),
    (FusedLamb, dict(weight_decay=0.0)),  # the ratio is lr
    (FusedLamb, dict(weight_decay=0.0, use_nvlamb=True)),
    (FusedLamb, dict(max_grad_norm=0.0, bias_correction=False, grad_averaging=False)),
    (FusedNovoGrad, {}),
    (FusedNovoGrad, dict(weight_decay=0.01, reg_inside_moment=True)),
    (FusedNovoGrad, dict(norm_type=0, weight_decay=0.01)),
    (FusedNovoGrad, dict(init_zero=True, bias_correction=False)),
]
# fp32: CUDA's ops contract multiply-adds and its norms sum in another order than the
# kernels' (~1e-7 relative per step, up to ~1e-6 where LAMB's |g| ~ eps); half
# precision: one rounding apart at |p| < 4 (tests/python/test_fused.py ULP).
ATOL = {torch.float32: 1e-5, torch.float16: 2.0 ** -10 * 4, torch.bfloat16: 2.0 ** -7 * 4}


def _params(device, dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(device, dtype)) for s in SHAPES]


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        grad = (torch.randn(p.shape, generator=g) * 0.5).to(p.device, p.dtype)
        p.grad = None if (i == 2 and step % 7 == 3) else grad


def _train(make, kwargs, device, dtype):
    params = _params(device, dtype)
    opt = make(params, **kwargs)
    for step in range(STEPS):
        _grads(params, step)
        opt.step()
    return params, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("make,kwargs", CASES,
                         ids=[f"{m.__name__}-{i}" for i, (m, _) in enumerate(CASES)])
def test_cuda_step_equals_the_cpu_kernels(make, kwargs, dtype):
    cpu, cpu_opt = _train(make, kwargs, "cpu", dtype)
    gpu, gpu_opt = _train(make, kwargs, "cuda", dtype)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert b.is_cuda and b.dtype == dtype
        torch.testing.assert_close(b.detach().cpu().float(), a.detach().float(), rtol=0,
                                   atol=ATOL[dtype], msg=lambda m: f"param {i}: {m}")
        sa, sb = cpu_opt.state[a], gpu_opt.state[b]
        assert sa["step"] == sb["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert sb[key].is_cuda and sb[key].dtype == torch.float32
            assert sb[key].shape == sa[key].shape
            torch.testing.assert_close(sb[key].cpu(), sa[key], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"state {i} {key}: {m}")


@pytest.mark.parametrize("make", [FusedLamb, FusedNovoGrad])
def test_cuda_step_does_not_sync_the_host(make):
    # Note [Device-generic steps]: the global norm, the clip factor, the per-tensor
    # norms and ratios stay on the device; torch raises on a synchronizing call.
    params = _params("cuda", torch.float32)
    opt = make(params, weight_decay=0.01)
    _grads(params, 0)
    opt.step()  # the state is created
    _grads(params, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_cuda_state_dict_loads_into_a_cpu_optimizer():
    # The same state layout on both paths: a CUDA run resumes on the CPU kernels.
    gpu, gpu_opt = _train(FusedLamb, {}, "cuda", torch.float32)
    cpu = [torch.nn.Parameter(p.detach().cpu()) for p in gpu]
    cpu_opt = FusedLamb(cpu)
    cpu_opt.load_state_dict(gpu_opt.state_dict())
    assert all(t.device.type == "cpu" for s in cpu_opt.state.values() for t in s.values()
               if torch.is_tensor(t))
    _grads(cpu, STEPS), _grads(gpu, STEPS)
    cpu_opt.step(), gpu_opt.step()
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=0, atol=1e-5,
                                   msg=lambda m: f"param {i}: {m}")
