// The per-tensor fp32 constants of the fused optimizers' steps (internal; included only
// from smp_core/optim/*.cpp and their tests), computed in one place for the CPU kernels
// (lamb.cpp, novograd.cpp) and the device-generic path (generic.cpp), so that both use
// the same bias corrections, clipping factor and rounding of the options to fp32
// (Note [LAMB step], Note [NovoGrad step], Note [Device-generic steps]).
#pragma once

#include <cmath>
#include <cstdint>

#include "smp_core/errors.h"
#include "smp_core/optim/lamb.h"
#include "smp_core/optim/novograd.h"

namespace smp::optim::detail {

// The ranges both optimizers' validate() check (lr, betas, eps, weight_decay), in that
// order; throws ConfigError "smp: <optimizer> <name>=<value> is not <allowed>".
inline void validate_common(const char* optimizer, double lr, double beta1, double beta2,
                            double eps, double weight_decay) {
  auto bad = [&](const char* name, double value, const char* allowed) {
    throw ConfigError(str_cat("smp: ", optimizer, " ", name, "=", value, " is not ", allowed));
  };
  if (!(lr >= 0)) bad("lr", lr, "a number >= 0");
  if (!(beta1 >= 0 && beta1 < 1)) bad("betas[0]", beta1, "in [0, 1)");
  if (!(beta2 >= 0 && beta2 < 1)) bad("betas[1]", beta2, "in [0, 1)");
  if (!(eps >= 0)) bad("eps", eps, "a number >= 0");
  if (!(weight_decay >= 0)) bad("weight_decay", weight_decay, "a number >= 0");
}

// One tensor's LAMB constants at its step `step` (>= 1).
struct LambConstants {
  float beta1, beta2, beta3, one_minus_beta2, inv_bc1, inv_sqrt_bc2, eps, decay, inv_clip;
};

// Note [LAMB step] 1: the reciprocal of the clipping factor, compared in fp32 as apex.
inline float lamb_inv_clip(double global_grad_norm, double max_grad_norm) {
  float norm = static_cast<float>(global_grad_norm);
  float max_norm = static_cast<float>(max_grad_norm);
  float clip = (max_norm > 0 && norm > max_norm) ? norm / max_norm : 1.0f;
  return 1.0f / clip;
}

inline LambConstants lamb_constants(const LambOptions& o, int64_t step, float inv_clip) {
  LambConstants s;
  s.beta1 = static_cast<float>(o.beta1);
  s.beta2 = static_cast<float>(o.beta2);
  s.beta3 = o.grad_averaging ? 1.0f - s.beta1 : 1.0f;
  s.one_minus_beta2 = 1.0f - s.beta2;
  double bc1 = o.bias_correction ? 1 - std::pow(s.beta1, step) : 1.0;
  double bc2 = o.bias_correction ? 1 - std::pow(s.beta2, step) : 1.0;
  s.inv_bc1 = static_cast<float>(1 / bc1);
  s.inv_sqrt_bc2 = static_cast<float>(1 / std::sqrt(bc2));
  s.eps = static_cast<float>(o.eps);
  s.decay = static_cast<float>(o.weight_decay);
  s.inv_clip = inv_clip;
  return s;
}

// One tensor's NovoGrad constants at its step `step` (>= 1), Note [NovoGrad step] 2-4;
// the denominator's reciprocal, which needs v, is the caller's: 1 / (v / bc2 + eps).
struct NovoGradConstants {
  float beta1, beta2, one_minus_beta2, beta3, inv_bc1, bc2, eps, decay, lr;
};

inline NovoGradConstants novograd_constants(const NovoGradOptions& o, int64_t step) {
  NovoGradConstants s;
  s.beta1 = static_cast<float>(o.beta1);
  s.beta2 = static_cast<float>(o.beta2);
  s.one_minus_beta2 = 1.0f - s.beta2;
  s.beta3 = o.grad_averaging ? 1.0f - s.beta1 : 1.0f;
  double bc1 = o.bias_correction ? 1 - std::pow(s.beta1, step) : 1.0;
  s.inv_bc1 = static_cast<float>(1 / bc1);
  s.bc2 = o.bias_correction ? static_cast<float>(std::sqrt(1 - std::pow(s.beta2, step))) : 1.0f;
  s.eps = static_cast<float>(o.eps);
  s.decay = static_cast<float>(o.weight_decay);
  s.lr = static_cast<float>(o.lr);
  return s;
}

}  // namespace smp::optim::detail
