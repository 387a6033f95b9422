// LAMB over a parameter group (lamb.h).
//
// Note [LAMB step]
// ~~~~~~~~~~~~~~~~
// apex's FusedLAMB (csrc/multi_tensor_lamb.cu) in fp32 math, step by step:
// 1. clip = global_grad_norm / max_grad_norm if the norm is above max_grad_norm, else
//    1; every gradient is divided by it.
// 2. L2 mode (adam_w_mode false): g += weight_decay * p.
// 3. m = beta1 m + beta3 g; v = beta2 v + (1 - beta2) g g.
// 4. u = (m / bc1) / (sqrt(v / bc2) + eps), bc = 1 - beta^step (1 without bias
//    correction); AdamW mode: u += weight_decay * p.
// 5. ratio = lr * ||p|| / ||u|| per tensor when the tensor has weight decay or
//    use_nvlamb is set, and both norms are nonzero; else lr. p -= ratio * u.
// apex writes u into the gradient between its two kernels; here the gradient is left
// as it was: the first pass stores m and v, writes u into a buffer of the block's size
// (kBlockElems, kept per calling thread) and sums p^2 and u^2; the second updates p
// from it. A tensor larger than a block has no room there: its second pass computes u
// again from the stored m, v and the unchanged p (the same fp32 operations, so the same
// bits: the files build without contraction, Note [Fused optimizer kernels]). A group
// whose ratio is lr (no weight decay, no NVLAMB) takes one pass.
//
// Memory traffic per fp32 parameter, when nothing stays in cache: the global norm reads
// g (4 bytes, the caller's pass), the first pass reads g, p, m, v and writes m, v, u
// (28), the second reads p, u and writes p (12): 44 bytes against AdamW's 28 (one pass:
// reads g, p, m, v, writes p, m, v). Where memory bandwidth bounds both (a CPU), LAMB's
// step costs ~1.6 AdamW's (bench/mixed_precision.py); AdamW with torch's gradient
// clipping, the same work as LAMB's clip, moves 40.
// apex keeps fp16 parameters' m and v in fp16 and rounds u to fp16; here state and u
// are fp32 for every parameter dtype, and only the new parameter is rounded. A division
// by a tensor's constant (clip, bc1, sqrt(bc2)) is a multiplication by its reciprocal,
// one division per element is left (apex's kernels build with --use_fast_math, whose
// divisions and roots are approximate: its own results differ from these in the last
// bits either way).
#include "smp_core/optim/lamb.h"

#include <algorithm>
#include <cmath>

#include "smp_core/errors.h"
#include "smp_core/optim/detail/generic.h"
#include "smp_core/optim/detail/multi_tensor.h"
#include "smp_core/optim/detail/step_constants.h"

namespace smp::optim {
namespace {

using detail::Chunk;
using detail::kLanes;
using detail::kTile;

// One tensor's fp32 constants (detail/step_constants.h).
using Scalars = detail::LambConstants;

// Steps 1-3 of Note [LAMB step] for one element.
template <bool kAdamW>
SMP_OPTIM_INLINE void moments(float g, float p, float& m, float& v, const Scalars& s) {
  float sg = g * s.inv_clip;
  if (!kAdamW) sg = sg + s.decay * p;
  m = m * s.beta1 + s.beta3 * sg;
  v = v * s.beta2 + s.one_minus_beta2 * sg * sg;
}

// Step 4: the update from the new m and v.
template <bool kAdamW>
SMP_OPTIM_INLINE float update(float m, float v, float p, const Scalars& s) {
  float u = (m * s.inv_bc1) / (std::sqrt(v) * s.inv_sqrt_bc2 + s.eps);
  if (kAdamW) u = u + s.decay * p;
  return u;
}

// First pass over a tile: m and v in place, the update into u.
template <bool kAdamW>
SMP_OPTIM_INLINE void tile_moments(const float* __restrict g, const float* __restrict p,
                                   float* __restrict m, float* __restrict v,
                                   float* __restrict u, int64_t n, const Scalars& s) {
  for (int64_t i = 0; i < n; ++i) {
    float mm = m[i], vv = v[i];
    moments<kAdamW>(g[i], p[i], mm, vv, s);
    m[i] = mm;
    v[i] = vv;
    u[i] = update<kAdamW>(mm, vv, p[i], s);
  }
}

// Second pass: p -= ratio * u, u again from the stored m and v.
template <bool kAdamW>
SMP_OPTIM_INLINE void tile_apply(float* __restrict p, const float* __restrict m,
                                 const float* __restrict v, int64_t n, const Scalars& s,
                                 float ratio) {
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] - ratio * update<kAdamW>(m[i], v[i], p[i], s);
}

// Both at once, where the ratio is lr.
template <bool kAdamW>
SMP_OPTIM_INLINE void tile_fused(const float* __restrict g, float* __restrict p,
                                 float* __restrict m, float* __restrict v, int64_t n,
                                 const Scalars& s, float lr) {
  for (int64_t i = 0; i < n; ++i) {
    float mm = m[i], vv = v[i], pp = p[i];
    moments<kAdamW>(g[i], pp, mm, vv, s);
    m[i] = mm;
    v[i] = vv;
    p[i] = pp - lr * update<kAdamW>(mm, vv, pp, s);
  }
}

// The loops above compiled for each instruction set (SMP_OPTIM_CLONES), per mode. The
// first pass writes the update into u and adds p^2 and u^2 into lanes_p and lanes_u.
template <bool kAdamW>
SMP_OPTIM_INLINE void first_pass(const float* g, const float* p, float* m, float* v, float* u,
                                 int64_t n, const Scalars& s, float* lanes_p, float* lanes_u) {
  tile_moments<kAdamW>(g, p, m, v, u, n, s);
  detail::add_squares(p, n, lanes_p);
  detail::add_squares(u, n, lanes_u);
}
SMP_OPTIM_CLONES void moments_adamw(const float* g, const float* p, float* m, float* v,
                                    float* u, int64_t n, const Scalars& s, float* lp,
                                    float* lu) {
  first_pass<true>(g, p, m, v, u, n, s, lp, lu);
}
SMP_OPTIM_CLONES void moments_l2(const float* g, const float* p, float* m, float* v, float* u,
                                 int64_t n, const Scalars& s, float* lp, float* lu) {
  first_pass<false>(g, p, m, v, u, n, s, lp, lu);
}
// The second pass from the kept updates.
SMP_OPTIM_CLONES void apply_kept(float* __restrict p, const float* __restrict u, int64_t n,
                                 float ratio) {
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] - ratio * u[i];
}
SMP_OPTIM_CLONES void apply_adamw(float* p, const float* m, const float* v, int64_t n,
                                  const Scalars& s, float ratio) {
  tile_apply<true>(p, m, v, n, s, ratio);
}
SMP_OPTIM_CLONES void apply_l2(float* p, const float* m, const float* v, int64_t n,
                               const Scalars& s, float ratio) {
  tile_apply<false>(p, m, v, n, s, ratio);
}
SMP_OPTIM_CLONES void fused_adamw(const float* g, float* p, float* m, float* v, int64_t n,
                                  const Scalars& s, float lr) {
  tile_fused<true>(g, p, m, v, n, s, lr);
}
SMP_OPTIM_CLONES void fused_l2(const float* g, float* p, float* m, float* v, int64_t n,
                               const Scalars& s, float lr) {
  tile_fused<false>(g, p, m, v, n, s, lr);
}

}  // namespace

void validate(const LambOptions& o) {
  detail::validate_common("FusedLamb", o.lr, o.beta1, o.beta2, o.eps, o.weight_decay);
  if (!(o.max_grad_norm >= 0)) {
    throw ConfigError(str_cat("smp: FusedLamb max_grad_norm=", o.max_grad_norm,
                              " is not a number >= 0 (0 or inf: no clipping)"));
  }
}

void lamb_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs,
               const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<int64_t>& steps,
               double global_grad_norm, const LambOptions& o) {
  if (detail::use_generic(params)) {
    return detail::lamb_step_generic(params, grads, exp_avgs, exp_avg_sqs, steps,
                                     detail::host_scalar(global_grad_norm), o);
  }
  validate(o);
  detail::check_group("lamb_step", params, grads,
                      {{"exp_avgs", exp_avgs, true}, {"exp_avg_sqs", exp_avg_sqs, true}},
                      steps);
  size_t n = params.size();
  detail::CpuGroup group(params, grads);
  const auto& ps = group.params;
  const auto& gs = group.grads;
  const auto& numels = group.numels;
  // Note [LAMB step] 1-4: the constants of each tensor.
  const float inv_clip = detail::lamb_inv_clip(global_grad_norm, o.max_grad_norm);
  std::vector<Scalars> scalars;
  scalars.reserve(n);
  for (size_t i = 0; i < n; ++i) scalars.push_back(detail::lamb_constants(o, steps[i], inv_clip));
  const float lr = static_cast<float>(o.lr);
  const bool adaptive = o.use_nvlamb || o.weight_decay != 0;
  auto moments_fn = o.adam_w_mode ? moments_adamw : moments_l2;
  auto apply_fn = o.adam_w_mode ? apply_adamw : apply_l2;
  auto fused_fn = o.adam_w_mode ? fused_adamw : fused_l2;

  // The updates of a block, kept from its first pass for its second; a tensor larger
  // than a block computes its update again instead (Note [LAMB step]).
  thread_local std::vector<float> kept;
  for (auto [first, last] : detail::make_blocks(numels, detail::kBlockElems)) {
    auto chunks = detail::make_chunks(numels, first, last);
    if (!adaptive) {
      detail::for_each_chunk(chunks, [&](int64_t c) {
        const Chunk& ch = chunks[c];
        float gbuf[kTile], pbuf[kTile];
        for (int64_t b = ch.begin; b < ch.end; b += kTile) {
          int64_t len = std::min(kTile, ch.end - b);
          detail::Tile g(gs[ch.tensor], b, len, gbuf), p(ps[ch.tensor].data, b, len, pbuf);
          fused_fn(g.data, p.data, detail::state_at(exp_avgs[ch.tensor], b),
                   detail::state_at(exp_avg_sqs[ch.tensor], b), len, scalars[ch.tensor], lr);
          p.store();
        }
      });
      continue;
    }
    std::vector<int64_t> offset(last - first + 1, 0);  // of each tensor's updates in `kept`
    for (size_t t = first; t < last; ++t) offset[t - first + 1] = offset[t - first] + numels[t];
    const bool keep = offset.back() <= detail::kBlockElems;
    if (keep && kept.size() < static_cast<size_t>(offset.back())) kept.resize(offset.back());
    float* const kept_at = kept.data();  // the calling thread's (thread_local), shared
    std::vector<double> sum_p(chunks.size()), sum_u(chunks.size());
    detail::for_each_chunk(chunks, [&](int64_t c) {
      const Chunk& ch = chunks[c];
      float gbuf[kTile], pbuf[kTile], ubuf[kTile];
      for (int64_t b = ch.begin; b < ch.end; b += kTile) {
        int64_t len = std::min(kTile, ch.end - b);
        detail::Tile g(gs[ch.tensor], b, len, gbuf), p(ps[ch.tensor].data, b, len, pbuf);
        float* u = keep ? kept_at + offset[ch.tensor - first] + b : ubuf;
        float lanes_p[kLanes] = {}, lanes_u[kLanes] = {};  // a tile's, added in double
        moments_fn(g.data, p.data, detail::state_at(exp_avgs[ch.tensor], b),
                   detail::state_at(exp_avg_sqs[ch.tensor], b), u, len, scalars[ch.tensor],
                   lanes_p, lanes_u);
        sum_p[c] += detail::sum_lanes(lanes_p);
        sum_u[c] += detail::sum_lanes(lanes_u);
      }
    });
    // Per tensor, in chunk order: ||p||^2 and ||u||^2, then the ratio (in fp32, as apex).
    std::vector<double> pp(last - first, 0.0), uu(last - first, 0.0);
    for (size_t c = 0; c < chunks.size(); ++c) {
      pp[chunks[c].tensor - first] += sum_p[c];
      uu[chunks[c].tensor - first] += sum_u[c];
    }
    std::vector<float> ratio(last - first);
    for (size_t t = 0; t < ratio.size(); ++t) {
      float pn = static_cast<float>(std::sqrt(pp[t]));
      float un = static_cast<float>(std::sqrt(uu[t]));
      ratio[t] = (pn != 0.0f && un != 0.0f) ? lr * (pn / un) : lr;
    }
    detail::for_each_chunk(chunks, [&](int64_t c) {
      const Chunk& ch = chunks[c];
      float pbuf[kTile];
      for (int64_t b = ch.begin; b < ch.end; b += kTile) {
        int64_t len = std::min(kTile, ch.end - b);
        detail::Tile p(ps[ch.tensor].data, b, len, pbuf);
        float r = ratio[ch.tensor - first];
        if (keep) {
          apply_kept(p.data, kept_at + offset[ch.tensor - first] + b, len, r);
        } else {
          apply_fn(p.data, detail::state_at(exp_avgs[ch.tensor], b),
                   detail::state_at(exp_avg_sqs[ch.tensor], b), len, scalars[ch.tensor], r);
        }
        p.store();
      }
    });
  }
  group.write_back();
}

void lamb_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs,
               const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<int64_t>& steps,
               const at::Tensor& global_grad_norm, const LambOptions& options) {
  if (detail::use_generic(params)) {
    return detail::lamb_step_generic(params, grads, exp_avgs, exp_avg_sqs, steps,
                                     global_grad_norm, options);
  }
  SMP_CHECK(global_grad_norm.numel() == 1, "optim: lamb_step: global_grad_norm has ",
            global_grad_norm.numel(), " elements, not 1");
  lamb_step(params, grads, exp_avgs, exp_avg_sqs, steps, global_grad_norm.item<double>(),
            options);
}

}  // namespace smp::optim
