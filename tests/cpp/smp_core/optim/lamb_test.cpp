// Note [LAMB step]: lamb_step against a scalar reference written here from the same
// formulas (apex's multi_tensor_lamb.cu), over sizes that cross the tile (1024), chunk
// (65536) and block (2^22) edges, in every mode, fp32, fp16 and bf16; and the same bits
// whatever the number of threads.
#include "smp_core/optim/lamb.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include "smp_core/errors.h"
#include "smp_core/optim/detail/multi_tensor.h"
#include "test_group.h"

namespace smp::optim {
namespace {

using test_util::clone;
using test_util::global_norm;
using test_util::Group;
using test_util::make_group;
using test_util::new_grads;

// Note [LAMB step], element by element in fp32, norms in double.
void reference_step(Group& grp, double global, const LambOptions& o) {
  float beta1 = o.beta1, beta2 = o.beta2, eps = o.eps, decay = o.weight_decay, lr = o.lr;
  float norm = global, max_norm = o.max_grad_norm;
  float clip = (max_norm > 0 && norm > max_norm) ? norm / max_norm : 1.0f;
  float beta3 = o.grad_averaging ? 1.0f - beta1 : 1.0f;
  for (size_t t = 0; t < grp.p.size(); ++t) {
    int64_t n = grp.p[t].numel();
    auto pf = grp.p[t].to(at::kFloat).contiguous(), gf = grp.g[t].to(at::kFloat).contiguous();
    float* p = pf.data_ptr<float>();
    const float* g = gf.data_ptr<float>();
    float* m = grp.m[t].data_ptr<float>();
    float* v = grp.v[t].data_ptr<float>();
    float bc1 = o.bias_correction ? float(1 - std::pow(beta1, grp.steps[t])) : 1.0f;
    float bc2 = o.bias_correction ? float(1 - std::pow(beta2, grp.steps[t])) : 1.0f;
    std::vector<float> u(n);
    double pp = 0, uu = 0;
    for (int64_t i = 0; i < n; ++i) {
      float sg = g[i] / clip;
      if (!o.adam_w_mode) sg = sg + decay * p[i];
      m[i] = m[i] * beta1 + beta3 * sg;
      v[i] = v[i] * beta2 + (1.0f - beta2) * sg * sg;
      u[i] = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps);
      if (o.adam_w_mode) u[i] = u[i] + decay * p[i];
      pp += double(p[i]) * p[i];
      uu += double(u[i]) * u[i];
    }
    float ratio = lr;
    if (o.use_nvlamb || decay != 0) {
      float pn = std::sqrt(pp), un = std::sqrt(uu);
      if (pn != 0 && un != 0) ratio = lr * (pn / un);
    }
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] - ratio * u[i];
    grp.p[t].copy_(pf);  // rounds to the parameter's dtype
  }
}

void kernel_step(Group& grp, double global, const LambOptions& o) {
  lamb_step(grp.p, grp.g, grp.m, grp.v, grp.steps, global, o);
}

// Largest |a - b| / (atol + rtol |b|).
double worst(const at::Tensor& a, const at::Tensor& b, double atol, double rtol) {
  auto a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  return ((a64 - b64).abs() / (atol + rtol * b64.abs())).max().item<double>();
}

void expect_close(const Group& got, const Group& want, double atol, double rtol,
                  const std::string& what) {
  for (size_t t = 0; t < got.p.size(); ++t) {
    if (got.p[t].numel() == 0) continue;
    EXPECT_LE(worst(got.p[t], want.p[t], atol, rtol), 1.0) << what << ": param " << t;
    EXPECT_LE(worst(got.m[t], want.m[t], 1e-7, 1e-6), 1.0) << what << ": exp_avg " << t;
    EXPECT_LE(worst(got.v[t], want.v[t], 1e-9, 1e-6), 1.0) << what << ": exp_avg_sq " << t;
  }
}

const std::vector<int64_t> kSizes = {0, 1, 17, 1024, 1040, (1 << 16) + 5, 3000};

struct Mode {
  const char* name;
  LambOptions options;
};

std::vector<Mode> modes() {
  std::vector<Mode> out;
  LambOptions o;
  out.push_back({"defaults", o});
  o.adam_w_mode = false;
  out.push_back({"l2", o});
  o = LambOptions();
  o.weight_decay = 0;
  out.push_back({"no decay (one pass)", o});
  o.use_nvlamb = true;
  out.push_back({"nvlamb without decay", o});
  o = LambOptions();
  o.bias_correction = false;
  o.grad_averaging = false;
  o.max_grad_norm = 0;
  out.push_back({"no bias correction, no averaging, no clip", o});
  o = LambOptions();
  o.max_grad_norm = 1e9;
  o.lr = 0.01;
  out.push_back({"clip never reached", o});
  return out;
}

TEST(Lamb, Fp32EqualsTheScalarReferenceInEveryMode) {
  for (const auto& mode : modes()) {
    Group got = make_group(kSizes, at::kFloat, 1);
    Group want = clone(got);
    for (int step = 0; step < 3; ++step) {
      new_grads(got, 100 + step, 0.5);
      new_grads(want, 100 + step, 0.5);
      double norm = global_norm(got);  // ~150: the default max_grad_norm=1 clips
      kernel_step(got, norm, mode.options);
      reference_step(want, norm, mode.options);
    }
    // The norms add in another order: the ratio differs in its last bits.
    expect_close(got, want, 1e-6, 1e-6, mode.name);
  }
}

TEST(Lamb, HalfAndBfloat16ParametersRoundOncePerStep) {
  // Math in fp32, the parameter rounded to its dtype each step (as the reference's
  // copy_): a rounding may go the other way where the ratios differ in their last
  // bits, so the tolerance is one unit in the last place of the dtype.
  for (auto [dtype, ulp] :
       {std::pair{at::kHalf, 1.0 / 1024}, std::pair{at::kBFloat16, 1.0 / 128}}) {
    for (const auto& mode : modes()) {
      Group got = make_group(kSizes, dtype, 2);
      Group want = clone(got);
      for (int step = 0; step < 3; ++step) {
        new_grads(got, 200 + step, 0.5);
        new_grads(want, 200 + step, 0.5);
        double norm = global_norm(got);
        kernel_step(got, norm, mode.options);
        reference_step(want, norm, mode.options);
      }
      for (size_t t = 0; t < got.p.size(); ++t) {
        if (got.p[t].numel() == 0) continue;
        EXPECT_EQ(got.p[t].scalar_type(), dtype);
        EXPECT_LE(worst(got.p[t], want.p[t], 1e-6, ulp), 1.0) << mode.name << " " << dtype;
      }
    }
  }
}

TEST(Lamb, BlocksLargerThanTheCacheBlockAndStridedParameters) {
  // A tensor of more than kBlockElems elements is a block alone, its update computed
  // again in the second pass; a transposed parameter is stepped through a contiguous
  // copy and written back.
  Group got = make_group({detail::kBlockElems + 3, 5000, 7}, at::kFloat, 3);
  got.p[1] = at::randn({50, 100}).t();
  got.m[1] = at::zeros({5000});
  got.v[1] = at::zeros({5000});
  Group want = clone(got);
  want.p[1] = got.p[1].clone();
  for (int step = 0; step < 2; ++step) {
    new_grads(got, 300 + step, 1.0);
    new_grads(want, 300 + step, 1.0);
    double norm = global_norm(got);
    kernel_step(got, norm, LambOptions());
    reference_step(want, norm, LambOptions());
  }
  EXPECT_FALSE(got.p[1].is_contiguous());
  expect_close(got, want, 1e-6, 1e-6, "blocks");
}

TEST(Lamb, TheSameBitsOnOneThreadAndOnSeveral) {
  int threads = at::get_num_threads();
  Group one = make_group(kSizes, at::kFloat, 4);
  new_grads(one, 400, 1.0);
  Group many = clone(one);
  at::set_num_threads(1);
  kernel_step(one, global_norm(one), LambOptions());
  at::set_num_threads(4);
  kernel_step(many, global_norm(many), LambOptions());
  at::set_num_threads(threads);
  for (size_t t = 0; t < one.p.size(); ++t) {
    EXPECT_TRUE(at::equal(one.p[t], many.p[t])) << "param " << t;
    EXPECT_TRUE(at::equal(one.v[t], many.v[t])) << "exp_avg_sq " << t;
  }
}

TEST(Lamb, BadOptionsAndMismatchedTensorsAreNamed) {
  LambOptions o;
  o.beta1 = 1.0;
  try {
    validate(o);
    FAIL() << "betas[0]=1 accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "smp: FusedLamb betas[0]=1 is not in [0, 1)");
  }
  o = LambOptions();
  o.max_grad_norm = -1;
  EXPECT_THROW(validate(o), ConfigError);
  Group grp = make_group({4}, at::kFloat, 5);
  new_grads(grp, 500, 1.0);
  grp.g[0] = grp.g[0].to(at::kDouble);
  try {
    kernel_step(grp, 1.0, LambOptions());
    FAIL() << "a float64 grad of a float32 param accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("param 0 is Float[4] but its grad Double[4]"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace smp::optim
