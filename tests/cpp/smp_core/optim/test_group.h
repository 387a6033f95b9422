// A parameter group of random tensors and its state, as the optimizer tests build it
// (lamb_test.cpp, novograd_test.cpp, generic_test.cpp). Test-only.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace smp::optim::test_util {

struct Group {
  std::vector<at::Tensor> p, g, m, v;
  std::vector<int64_t> steps;
};

// Params of `sizes` (randn, then `dtype`), m zeros of their size, v zeros of their size
// (LAMB) or one 0-d zero each (`v_per_tensor`, NovoGrad's norm average).
inline Group make_group(const std::vector<int64_t>& sizes, at::ScalarType dtype, uint64_t seed,
                        bool v_per_tensor = false) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Group grp;
  for (int64_t n : sizes) {
    grp.p.push_back(at::randn({n}, gen).to(dtype));
    grp.m.push_back(at::zeros({n}));
    grp.v.push_back(v_per_tensor ? at::zeros({}) : at::zeros({n}));
    grp.steps.push_back(0);
  }
  return grp;
}

// New gradients (randn * scale in the params' dtype), and the next step's number.
inline void new_grads(Group& grp, uint64_t seed, double scale = 1.0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  grp.g.clear();
  for (const auto& p : grp.p) {
    grp.g.push_back((at::randn(p.sizes(), gen) * scale).to(p.scalar_type()));
  }
  for (auto& s : grp.steps) ++s;
}

inline Group clone(const Group& grp) {
  Group c;
  for (size_t i = 0; i < grp.p.size(); ++i) {
    c.p.push_back(grp.p[i].clone());
    c.m.push_back(grp.m[i].clone());
    c.v.push_back(grp.v[i].clone());
  }
  for (const auto& g : grp.g) c.g.push_back(g.clone());
  c.steps = grp.steps;
  return c;
}

// The L2 norm of every gradient, in double.
inline double global_norm(const Group& grp) {
  double s = 0;
  for (const auto& g : grp.g) s += g.to(at::kDouble).pow(2).sum().item<double>();
  return std::sqrt(s);
}

}  // namespace smp::optim::test_util
