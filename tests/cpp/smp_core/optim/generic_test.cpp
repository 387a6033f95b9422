// Note [Device-generic steps]: the ATen-op steps (detail/generic.h) against the CPU
// kernels on the CPU, over sizes that cross the tile and chunk edges and an empty
// tensor, in the modes that change the arithmetic: fp32 within 1e-6 after 20 steps,
// the same state layout; and the dispatch (SMP_OPTIM_GENERIC) of lamb_step.
#include "smp_core/optim/detail/generic.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "smp_core/optim/detail/multi_tensor.h"
#include "smp_core/optim/norms.h"
#include "test_group.h"

namespace smp::optim {
namespace {

using test_util::clone;
using test_util::global_norm;
using test_util::Group;
using test_util::make_group;
using test_util::new_grads;

const std::vector<int64_t> kSizes = {detail::kTile + 1, detail::kChunk + 3, 7, 0, 1};
constexpr int kSteps = 20;

void expect_close(const Group& got, const Group& want, double atol, const std::string& what) {
  for (size_t i = 0; i < got.p.size(); ++i) {
    for (auto [a, b, name] : {std::tuple{got.p[i], want.p[i], "p"}, {got.m[i], want.m[i], "m"},
                              {got.v[i], want.v[i], "v"}}) {
      ASSERT_EQ(a.sizes(), b.sizes()) << what << " " << name << i;
      if (a.numel() == 0) continue;
      double diff = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
      double tol = name == std::string("p") ? atol : atol + 1e-5 * b.abs().max().item<double>();
      EXPECT_LE(diff, tol) << what << ": " << name << "[" << i << "]";
    }
  }
}

TEST(Generic, LambEqualsTheKernel) {
  std::vector<std::pair<std::string, LambOptions>> modes = {{"defaults (clips)", {}}};
  LambOptions o;
  o.adam_w_mode = false;
  modes.push_back({"L2", o});
  o = LambOptions();
  o.weight_decay = 0;
  modes.push_back({"no decay (ratio lr)", o});
  o.use_nvlamb = true;
  modes.push_back({"nvlamb", o});
  for (const auto& [what, opts] : modes) {
    Group kernel = make_group(kSizes, at::kFloat, 1);
    Group generic = clone(kernel);
    for (int step = 0; step < kSteps; ++step) {
      new_grads(kernel, 100 + step, 0.5);
      new_grads(generic, 100 + step, 0.5);
      double norm = global_norm(kernel);
      lamb_step(kernel.p, kernel.g, kernel.m, kernel.v, kernel.steps, norm, opts);
      // The norm on the host (a CPU tensor) and as the device path gets it.
      detail::lamb_step_generic(generic.p, generic.g, generic.m, generic.v, generic.steps,
                                sum_of_squares_tensor(generic.g).sqrt(), opts);
    }
    expect_close(generic, kernel, 1e-6, what);
  }
}

TEST(Generic, NovoGradEqualsTheKernel) {
  std::vector<std::pair<std::string, NovoGradOptions>> modes = {{"defaults", {}}};
  NovoGradOptions o;
  o.reg_inside_moment = true;
  o.weight_decay = 0.01;
  modes.push_back({"reg_inside_moment", o});
  o = NovoGradOptions();
  o.norm_type = NovoGradNorm::kInf;
  o.init_zero = true;
  modes.push_back({"inf norm, init_zero", o});
  for (const auto& [what, opts] : modes) {
    Group kernel = make_group(kSizes, at::kFloat, 2, /*v_per_tensor=*/true);
    Group generic = clone(kernel);
    for (int step = 0; step < kSteps; ++step) {
      new_grads(kernel, 200 + step);
      new_grads(generic, 200 + step);
      novograd_step(kernel.p, kernel.g, kernel.m, kernel.v, kernel.steps, opts);
      detail::novograd_step_generic(generic.p, generic.g, generic.m, generic.v, generic.steps,
                                    opts);
    }
    expect_close(generic, kernel, 1e-6, what);
  }
}

TEST(Generic, TheEnvironmentVariableSendsCpuTensorsThere) {
  std::vector<at::Tensor> cpu = {at::zeros({2})};
  unsetenv(detail::kGenericEnv);
  EXPECT_FALSE(detail::use_generic(cpu));
  setenv(detail::kGenericEnv, "0", 1);
  EXPECT_FALSE(detail::use_generic(cpu));
  setenv(detail::kGenericEnv, "1", 1);
  EXPECT_TRUE(detail::use_generic(cpu));
  unsetenv(detail::kGenericEnv);
  EXPECT_DOUBLE_EQ(sum_of_squares_tensor({at::full({3}, 2.0f)}).item<double>(), 12.0);
}

}  // namespace
}  // namespace smp::optim
