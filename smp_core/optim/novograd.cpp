// NovoGrad over a parameter group (novograd.h).
//
// Note [NovoGrad step]
// ~~~~~~~~~~~~~~~~~~~~
// apex's FusedNovoGrad (csrc/multi_tensor_novograd.cu and the norm blend of
// multi_tensor_l2norm_kernel.cu) in fp32 math, per tensor:
// 1. n = ||g||_2 (L2; s = n^2 the sum of squares) or max |g| (inf).
// 2. On the tensor's first step v = n, unless init_zero (v = 0). Then every step
//    v = sqrt(beta2 v^2 + (1 - beta2) s) (L2) or beta2 v + (1 - beta2) n (inf), so a
//    first step that starts at n keeps n.
// 3. bc1 = 1 - beta1^step, bc2 = sqrt(1 - beta2^step) (both 1 without bias correction);
//    denom = v / bc2 + eps.
// 4. Per element, beta3 = 1 - beta1 with grad_averaging (else 1):
//    default (apex moment mode 1): m = beta1 m + beta3 g;
//                                  p -= lr ((m / bc1) / denom + weight_decay p)
//    reg_inside_moment (mode 0):   m = beta1 m + beta3 (g / denom + weight_decay p);
//                                  p -= lr (m / bc1)
// Divisions by a tensor's constants (bc1, denom) are multiplications by their
// reciprocals: no division per element (apex's --use_fast_math divisions are
// approximate too, Note [LAMB step]).
// apex keeps v of a group in one tensor per dtype in the param group; here each
// parameter holds its own (a one-element fp32 tensor), so a parameter's step does not
// depend on which others are stepped with it (optimizer-state sharding steps a share
// of the group at a time). m is fp32 for every parameter dtype (apex: the parameter's).
#include "smp_core/optim/novograd.h"

#include <algorithm>
#include <cmath>

#include "smp_core/errors.h"
#include "smp_core/optim/detail/generic.h"
#include "smp_core/optim/detail/multi_tensor.h"
#include "smp_core/optim/detail/step_constants.h"

namespace smp::optim {
namespace {

using detail::Chunk;
using detail::kTile;

// One tensor's fp32 constants (Note [NovoGrad step] 3-4).
struct Scalars {
  float beta1, beta3, inv_bc1, inv_denom, decay, lr;
};

template <bool kInside>
SMP_OPTIM_INLINE void tile_update(const float* __restrict g, float* __restrict p,
                                  float* __restrict m, int64_t n, const Scalars& s) {
  for (int64_t i = 0; i < n; ++i) {
    if (kInside) {
      float gn = g[i] * s.inv_denom + s.decay * p[i];
      m[i] = s.beta1 * m[i] + s.beta3 * gn;
      p[i] = p[i] - s.lr * (m[i] * s.inv_bc1);
    } else {
      m[i] = s.beta1 * m[i] + s.beta3 * g[i];
      float u = (m[i] * s.inv_bc1) * s.inv_denom + s.decay * p[i];
      p[i] = p[i] - s.lr * u;
    }
  }
}

SMP_OPTIM_CLONES void update_outside(const float* g, float* p, float* m, int64_t n,
                                     const Scalars& s) {
  tile_update<false>(g, p, m, n, s);
}
SMP_OPTIM_CLONES void update_inside(const float* g, float* p, float* m, int64_t n,
                                    const Scalars& s) {
  tile_update<true>(g, p, m, n, s);
}

}  // namespace

void validate(const NovoGradOptions& o) {
  detail::validate_common("FusedNovoGrad", o.lr, o.beta1, o.beta2, o.eps, o.weight_decay);
  if (o.norm_type != NovoGradNorm::kL2 && o.norm_type != NovoGradNorm::kInf) {
    throw ConfigError(str_cat("smp: FusedNovoGrad norm_type=", static_cast<int>(o.norm_type),
                              " is not one of {2 (L2), 0 (infinity)}"));
  }
}

void novograd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& exp_avgs,
                   const std::vector<at::Tensor>& grad_norms, const std::vector<int64_t>& steps,
                   const NovoGradOptions& o) {
  if (detail::use_generic(params)) {
    return detail::novograd_step_generic(params, grads, exp_avgs, grad_norms, steps, o);
  }
  validate(o);
  detail::check_group("novograd_step", params, grads,
                      {{"exp_avgs", exp_avgs, true}, {"grad_norms", grad_norms, false}}, steps);
  detail::CpuGroup group(params, grads);
  const auto& ps = group.params;
  const auto& gs = group.grads;
  const auto& numels = group.numels;
  const bool inf = o.norm_type == NovoGradNorm::kInf;
  auto update_fn = o.reg_inside_moment ? update_inside : update_outside;

  for (auto [first, last] : detail::make_blocks(numels, detail::kBlockElems)) {
    // Note [NovoGrad step] 1-3, per tensor of the block.
    std::vector<double> norms = detail::reduce_tensors(gs, first, last, inf);
    std::vector<Scalars> scalars(last - first);
    for (size_t t = first; t < last; ++t) {
      const detail::NovoGradConstants c = detail::novograd_constants(o, steps[t]);
      float s = static_cast<float>(norms[t - first]);  // sum of squares, or max |g|
      float fresh = inf ? s : static_cast<float>(std::sqrt(norms[t - first]));
      float* v = grad_norms[t].data_ptr<float>();
      if (steps[t] == 1) *v = o.init_zero ? 0.0f : fresh;
      *v = inf ? c.beta2 * *v + c.one_minus_beta2 * s
               : std::sqrt(c.beta2 * *v * *v + c.one_minus_beta2 * s);
      scalars[t - first] = {c.beta1, c.beta3, c.inv_bc1, 1.0f / (*v / c.bc2 + c.eps), c.decay,
                            c.lr};
    }
    // 4: the update, tile by tile.
    auto chunks = detail::make_chunks(numels, first, last);
    detail::for_each_chunk(chunks, [&](int64_t c) {
      const Chunk& ch = chunks[c];
      float gbuf[kTile], pbuf[kTile];
      for (int64_t b = ch.begin; b < ch.end; b += kTile) {
        int64_t len = std::min(kTile, ch.end - b);
        detail::Tile g(gs[ch.tensor], b, len, gbuf), p(ps[ch.tensor].data, b, len, pbuf);
        update_fn(g.data, p.data, detail::state_at(exp_avgs[ch.tensor], b), len,
                  scalars[ch.tensor - first]);
        p.store();
      }
    });
  }
  group.write_back();
}

}  // namespace smp::optim
