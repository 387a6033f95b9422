// The fused optimizers' device-generic steps (detail/generic.h).
//
// Note [Device-generic steps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The CPU kernels (Note [Fused optimizer kernels]) read tensors through raw pointers,
// so they step CPU tensors only. Everywhere else (CUDA, or any device ATen has) the
// same update runs as ATen ops: at::_foreach_* over the group where every tensor of a
// list gets the same constant or a constant of its own (a Scalar list), per-tensor ops
// where the constant is a device tensor (the clip factor, LAMB's trust ratio,
// NovoGrad's denominator). Every op used exists in torch 1.13 and 2.x with the same
// C++ signature (_foreach_norm since 1.10), so nothing here goes through compat/.
// - The same arithmetic: the constants come from detail/step_constants.h (shared with
//   the kernels), each term is the kernel's term, op by op in the kernel's order, in
//   fp32: a half-precision parameter or gradient is copied to fp32 per tensor, and the
//   parameter written back with copy_ (round to nearest even, as the kernels). The
//   state layout is the kernels' (state_dicts move between the paths).
// - Not the same bits: norms sum in another order (_foreach_norm: fp32 on every
//   device, the kernels: fp32 lanes added in double), ATen divides by a Scalar as a
//   multiplication by its reciprocal, and its CPU/CUDA ops may fuse multiply-adds. The
//   paths agree to ~1e-7 relative per step (tests/python/test_fused.py compares them).
//   The global sum of squares (sum_of_squares_generic) is float64, one tensor's copy at
//   a time: LAMB's update amplifies an error of the clip factor by up to 1 / eps where
//   |g| ~ eps, and fp32 norms there moved parameters by 1e-6 in 20 steps.
// - No host sync: scalars that depend on the data stay device tensors (the global norm
//   when the caller passes it on the device, the per-tensor norms, the clip factor, the
//   ratios and NovoGrad's v), and a branch on one is at::where, never .item(). What the
//   host knows (steps, options, a CPU global norm) is passed as Scalars.
// - Cost: ~10 foreach launches per group plus a few tiny per-tensor ops (LAMB: 3 for
//   the ratio, 1 to apply it; NovoGrad: 1-2), and fp32 temporaries of a group's size
//   (the scaled gradient, the update). apex's fused CUDA kernels do it in two launches;
//   this path is for correctness on every device first.
// - SMP_OPTIM_GENERIC=1 (kGenericEnv) sends CPU tensors here too: the tests compare
//   both paths on one machine that has no GPU.
#include "smp_core/optim/detail/generic.h"

#include <cstdlib>
#include <cstring>
#include <limits>

#include <ATen/Functions.h>

#include "smp_core/config.h"
#include "smp_core/errors.h"
#include "smp_core/optim/detail/multi_tensor.h"
#include "smp_core/optim/detail/step_constants.h"

namespace smp::optim::detail {
namespace {

using Tensors = std::vector<at::Tensor>;

// Each tensor as fp32: itself, or a converted copy.
Tensors as_float(const Tensors& ts) {
  Tensors out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(t.scalar_type() == at::kFloat ? t : t.to(at::kFloat));
  return out;
}

// Each state tensor viewed with its parameter's shape (the state is contiguous, maybe
// flat), or as one element (`shaped` false).
Tensors views(const Tensors& state, const Tensors& params, bool shaped) {
  Tensors out;
  out.reserve(state.size());
  for (size_t i = 0; i < state.size(); ++i) {
    out.push_back(state[i].view(shaped ? params[i].sizes() : at::IntArrayRef()));
  }
  return out;
}

// The fp32 copies of half-precision parameters back into them (fp32 ones were updated
// in place).
void write_back(const Tensors& params, const Tensors& p32) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (!p32[i].is_same(params[i])) params[i].copy_(p32[i]);
  }
}

std::vector<at::Scalar> scalars(const std::vector<float>& v) {
  return std::vector<at::Scalar>(v.begin(), v.end());
}

// ord-norm of each tensor (fp32, 0-d, on its device); 0 for an empty one, as the
// kernels (ATen refuses the inf-norm of nothing).
Tensors norms(const Tensors& ts, double ord) {
  Tensors nonempty;
  for (const auto& t : ts) {
    if (t.numel() > 0) nonempty.push_back(t);
  }
  Tensors some = nonempty.empty() ? Tensors() : at::_foreach_norm(nonempty, ord);
  Tensors out;
  size_t k = 0;
  for (const auto& t : ts) {
    out.push_back(t.numel() > 0 ? some[k++] : at::zeros({}, t.options().dtype(at::kFloat)));
  }
  return out;
}

}  // namespace

bool use_generic(const std::vector<at::Tensor>& tensors) {
  if (env_flag(kGenericEnv, false, "CPU tensors take the generic (ATen) path too")) return true;
  for (const auto& t : tensors) {
    if (!t.device().is_cpu()) return true;
  }
  return false;
}

at::Tensor host_scalar(double value) { return at::scalar_tensor(value, at::kDouble); }

void lamb_step_generic(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs,
                       const Tensors& exp_avg_sqs, const std::vector<int64_t>& steps,
                       const at::Tensor& global_grad_norm, const LambOptions& o) {
  validate(o);
  check_group("lamb_step", params, grads,
              {{"exp_avgs", exp_avgs, true}, {"exp_avg_sqs", exp_avg_sqs, true}}, steps);
  SMP_CHECK(global_grad_norm.numel() == 1, "optim: lamb_step: global_grad_norm has ",
            global_grad_norm.numel(), " elements, not 1");
  if (params.empty()) return;
  const size_t n = params.size();
  Tensors p32 = as_float(params), g32 = as_float(grads);
  Tensors m = views(exp_avgs, params, true), v = views(exp_avg_sqs, params, true);

  // Note [LAMB step] 1: the clip factor, on the host when the norm is there.
  Tensors sg;
  if (global_grad_norm.device().is_cpu()) {
    float inv_clip = lamb_inv_clip(global_grad_norm.item<double>(), o.max_grad_norm);
    sg = inv_clip == 1.0f ? g32 : at::_foreach_mul(g32, static_cast<double>(inv_clip));
  } else if (static_cast<float>(o.max_grad_norm) > 0) {
    // lamb_inv_clip on the device: a true division (not ATen's by a Scalar).
    at::Tensor norm = global_grad_norm.reshape({}).to(at::kFloat);
    float max_norm = static_cast<float>(o.max_grad_norm);
    at::Tensor clip = at::where(norm.gt(max_norm), norm.div(at::full({}, max_norm, norm.options())),
                                at::ones_like(norm));
    at::Tensor inv_clip = clip.reciprocal();
    for (const auto& g : g32) sg.push_back(g.mul(inv_clip.to(g.device())));
  } else {
    sg = g32;
  }
  std::vector<float> inv_bc1(n), inv_sqrt_bc2(n);
  LambConstants c{};
  for (size_t i = 0; i < n; ++i) {
    c = lamb_constants(o, steps[i], 1.0f);
    inv_bc1[i] = c.inv_bc1;
    inv_sqrt_bc2[i] = c.inv_sqrt_bc2;
  }
  // 2. L2 mode: g + decay p (sg is a new list: the gradients stay as they were).
  if (!o.adam_w_mode) sg = at::_foreach_add(sg, at::_foreach_mul(p32, c.decay));
  // 3. m = m beta1 + beta3 g; v = v beta2 + ((1 - beta2) g) g.
  at::_foreach_mul_(m, c.beta1);
  at::_foreach_add_(m, at::_foreach_mul(sg, c.beta3));
  at::_foreach_mul_(v, c.beta2);
  Tensors g2 = at::_foreach_mul(sg, c.one_minus_beta2);
  at::_foreach_mul_(g2, sg);
  at::_foreach_add_(v, g2);
  g2.clear();
  // 4. u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) [+ decay p].
  Tensors u = at::_foreach_mul(m, scalars(inv_bc1));
  Tensors den = at::_foreach_sqrt(v);
  at::_foreach_mul_(den, scalars(inv_sqrt_bc2));
  at::_foreach_add_(den, c.eps);
  at::_foreach_div_(u, den);
  den.clear();
  if (o.adam_w_mode) at::_foreach_add_(u, at::_foreach_mul(p32, c.decay));
  // 5. p -= ratio u, ratio = lr ||p|| / ||u|| where both are nonzero (else lr).
  const float lr = static_cast<float>(o.lr);
  if (o.use_nvlamb || o.weight_decay != 0) {
    Tensors pn = norms(p32, 2), un = norms(u, 2);
    for (size_t i = 0; i < n; ++i) {
      at::Tensor ratio = at::where(pn[i].ne(0).logical_and(un[i].ne(0)), pn[i].div(un[i]).mul(lr),
                                   at::full_like(pn[i], lr));
      u[i].mul_(ratio);
    }
  } else {
    at::_foreach_mul_(u, lr);
  }
  at::_foreach_sub_(p32, u);
  write_back(params, p32);
}

void novograd_step_generic(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs,
                           const Tensors& grad_norms, const std::vector<int64_t>& steps,
                           const NovoGradOptions& o) {
  validate(o);
  check_group("novograd_step", params, grads,
              {{"exp_avgs", exp_avgs, true}, {"grad_norms", grad_norms, false}}, steps);
  if (params.empty()) return;
  const size_t n = params.size();
  const bool inf = o.norm_type == NovoGradNorm::kInf;
  Tensors p32 = as_float(params), g32 = as_float(grads);
  Tensors m = views(exp_avgs, params, true), v = views(grad_norms, params, false);
  std::vector<float> inv_bc1(n), bc2(n);
  NovoGradConstants c{};
  for (size_t i = 0; i < n; ++i) {
    c = novograd_constants(o, steps[i]);
    inv_bc1[i] = c.inv_bc1;
    bc2[i] = c.bc2;
  }
  // Note [NovoGrad step] 1: n per tensor; s = n^2 (L2) or n (inf).
  Tensors fresh = norms(g32, inf ? std::numeric_limits<double>::infinity() : 2.0);
  Tensors s = inf ? fresh : at::_foreach_mul(fresh, fresh);
  // 2. v starts at n (or 0), then v = beta2 v + (1 - beta2) s, or
  //    sqrt(v (beta2 v) + (1 - beta2) s).
  for (size_t i = 0; i < n; ++i) {
    if (steps[i] != 1) continue;
    if (o.init_zero) {
      v[i].zero_();
    } else {
      v[i].copy_(fresh[i]);
    }
  }
  if (inf) {
    at::_foreach_mul_(v, c.beta2);
    at::_foreach_add_(v, at::_foreach_mul(s, c.one_minus_beta2));
  } else {
    at::_foreach_mul_(v, at::_foreach_mul(v, c.beta2));
    at::_foreach_add_(v, at::_foreach_mul(s, c.one_minus_beta2));
    at::_foreach_sqrt_(v);
  }
  // 3. 1 / denom = 1 / (v / bc2 + eps).
  Tensors inv_denom = at::_foreach_div(v, scalars(bc2));
  at::_foreach_add_(inv_denom, c.eps);
  at::_foreach_reciprocal_(inv_denom);
  // 4. The moment and the parameter.
  Tensors u;
  if (o.reg_inside_moment) {
    // m = beta1 m + beta3 (g / denom + decay p); p -= lr (m / bc1).
    Tensors gn;
    for (size_t i = 0; i < n; ++i) gn.push_back(g32[i].mul(inv_denom[i]));
    at::_foreach_add_(gn, at::_foreach_mul(p32, c.decay));
    at::_foreach_mul_(m, c.beta1);
    at::_foreach_add_(m, at::_foreach_mul(gn, c.beta3));
    u = at::_foreach_mul(m, scalars(inv_bc1));
  } else {
    // m = beta1 m + beta3 g; p -= lr ((m / bc1) / denom + decay p).
    at::_foreach_mul_(m, c.beta1);
    at::_foreach_add_(m, at::_foreach_mul(g32, c.beta3));
    u = at::_foreach_mul(m, scalars(inv_bc1));
    for (size_t i = 0; i < n; ++i) u[i].mul_(inv_denom[i]);
    at::_foreach_add_(u, at::_foreach_mul(p32, c.decay));
  }
  at::_foreach_mul_(u, c.lr);
  at::_foreach_sub_(p32, u);
  write_back(params, p32);
}

at::Tensor sum_of_squares_generic(const Tensors& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto dt = tensors[i].scalar_type();
    SMP_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "optim: sum_of_squares: tensor ", i, " has dtype ", dt,
              ", not one of {float32, float16, bfloat16}");
  }
  if (tensors.empty()) return at::zeros({}, at::kDouble);
  // In float64 (the kernel: fp32 lanes added in double): LAMB's update amplifies an
  // error of the clip factor by up to 1 / eps where |g| ~ eps (Note [Device-generic
  // steps]). One tensor at a time, so a float64 copy of the largest only.
  const auto device = tensors[0].device();
  Tensors each;
  for (const auto& t : tensors) each.push_back(t.to(at::kDouble).square().sum().to(device));
  return at::stack(each).sum();
}

}  // namespace smp::optim::detail
