// Note [NovoGrad step]: novograd_step against a scalar reference written here from
// apex's multi_tensor_novograd.cu and its norm blend, in every mode and norm, over
// sizes that cross the tile, chunk and block edges; fp32, fp16 and bf16.
#include "smp_core/optim/novograd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "smp_core/errors.h"
#include "test_group.h"

namespace smp::optim {
namespace {

using test_util::clone;
using test_util::Group;
using test_util::new_grads;

Group make_group(const std::vector<int64_t>& sizes, at::ScalarType dtype, uint64_t seed) {
  return test_util::make_group(sizes, dtype, seed, /*v_per_tensor=*/true);
}

// Note [NovoGrad step], element by element in fp32, norms in double.
void reference_step(Group& grp, const NovoGradOptions& o) {
  float beta1 = o.beta1, beta2 = o.beta2, eps = o.eps, decay = o.weight_decay, lr = o.lr;
  float beta3 = o.grad_averaging ? 1.0f - beta1 : 1.0f;
  bool inf = o.norm_type == NovoGradNorm::kInf;
  for (size_t t = 0; t < grp.p.size(); ++t) {
    int64_t n = grp.p[t].numel();
    auto pf = grp.p[t].to(at::kFloat).contiguous(), gf = grp.g[t].to(at::kFloat).contiguous();
    float* p = pf.data_ptr<float>();
    const float* g = gf.data_ptr<float>();
    float* m = grp.m[t].data_ptr<float>();
    double s = 0;
    for (int64_t i = 0; i < n; ++i) {
      s = inf ? std::max(s, double(std::fabs(g[i]))) : s + double(g[i]) * g[i];
    }
    float& v = *grp.v[t].data_ptr<float>();
    if (grp.steps[t] == 1) v = o.init_zero ? 0.0f : float(inf ? s : std::sqrt(s));
    v = inf ? beta2 * v + (1.0f - beta2) * float(s)
            : std::sqrt(beta2 * v * v + (1.0f - beta2) * float(s));
    float bc1 = o.bias_correction ? float(1 - std::pow(beta1, grp.steps[t])) : 1.0f;
    float bc2 = o.bias_correction ? float(std::sqrt(1 - std::pow(beta2, grp.steps[t]))) : 1.0f;
    float denom = v / bc2 + eps;
    for (int64_t i = 0; i < n; ++i) {
      if (o.reg_inside_moment) {
        m[i] = beta1 * m[i] + beta3 * (g[i] / denom + decay * p[i]);
        p[i] = p[i] - lr * (m[i] / bc1);
      } else {
        m[i] = beta1 * m[i] + beta3 * g[i];
        p[i] = p[i] - lr * ((m[i] / bc1) / denom + decay * p[i]);
      }
    }
    grp.p[t].copy_(pf);
  }
}

double worst(const at::Tensor& a, const at::Tensor& b, double atol, double rtol) {
  auto a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  return ((a64 - b64).abs() / (atol + rtol * b64.abs())).max().item<double>();
}

std::vector<std::pair<std::string, NovoGradOptions>> modes() {
  std::vector<std::pair<std::string, NovoGradOptions>> out;
  NovoGradOptions o;
  out.emplace_back("defaults", o);
  o.weight_decay = 0.01;
  out.emplace_back("decay", o);
  o.reg_inside_moment = true;
  out.emplace_back("reg inside moment", o);
  o.norm_type = NovoGradNorm::kInf;
  out.emplace_back("inf norm, reg inside", o);
  o.reg_inside_moment = false;
  o.init_zero = true;
  out.emplace_back("inf norm, init zero", o);
  o = NovoGradOptions();
  o.init_zero = true;
  o.bias_correction = false;
  o.grad_averaging = false;
  out.emplace_back("init zero, no bias correction, no averaging", o);
  return out;
}

// The fourth crosses a chunk; blocks of up to kBlockElems (2^22) elements hold several.
const std::vector<int64_t> kSizes = {0, 1, 17, 1040, (1 << 16) + 5, (1 << 20) + 1, 3000};

TEST(NovoGrad, EqualsTheScalarReferenceInEveryModeAndDtype) {
  for (auto [dtype, rtol] : {std::pair{at::kFloat, 1e-6}, std::pair{at::kHalf, 1.0 / 1024},
                             std::pair{at::kBFloat16, 1.0 / 128}}) {
    for (const auto& [name, options] : modes()) {
      Group got = make_group(kSizes, dtype, 1);
      Group want = clone(got);
      for (int step = 0; step < 3; ++step) {
        new_grads(got, 10 + step);
        new_grads(want, 10 + step);
        novograd_step(got.p, got.g, got.m, got.v, got.steps, options);
        reference_step(want, options);
      }
      for (size_t t = 0; t < got.p.size(); ++t) {
        if (got.p[t].numel() == 0) continue;
        // fp32: the norms add in another order (last bits of v); fp16/bf16: that may
        // turn a rounding of the parameter, one unit in its last place.
        EXPECT_LE(worst(got.p[t], want.p[t], 1e-6, rtol), 1.0)
            << name << " " << dtype << " " << t;
        EXPECT_LE(worst(got.v[t], want.v[t], 1e-7, 1e-6), 1.0) << name << " v " << t;
        EXPECT_LE(worst(got.m[t], want.m[t], 1e-7, dtype == at::kFloat ? 1e-6 : rtol), 1.0)
            << name << " m " << t;
      }
    }
  }
}

TEST(NovoGrad, BadOptionsAreNamed) {
  NovoGradOptions o;
  o.norm_type = static_cast<NovoGradNorm>(1);
  try {
    validate(o);
    FAIL() << "norm_type=1 accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "smp: FusedNovoGrad norm_type=1 is not one of {2 (L2), 0 (infinity)}");
  }
  o = NovoGradOptions();
  o.lr = -1;
  EXPECT_THROW(validate(o), ConfigError);
}

}  // namespace
}  // namespace smp::optim
