// Built-in comm hooks through the Reducer over real Gloo ranks (threads). Rank r's
// gradients are g(r) = (r + 1) * 1.1 (not exact in 16 bits), so the exact average is
// 1.1 * (n + 1) / 2; compressed hooks must land within their format's rounding.
#include "hooks/builtin.h"
#include "hooks/debugging_hooks.h"
#include "hooks/default_hooks.h"
#include "hooks/quantization_hooks.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../common/gloo_world.h"
#include "hooks/detail/collectives.h"
#include "smp_core/errors.h"
#include "smp_core/reducer.h"

namespace smp::hooks {
namespace {

using smp::testing::run_gloo_world;

std::vector<at::Tensor> make_params() {
  std::vector<at::Tensor> ps;
  for (int64_t n : {5, 300, 1, 64}) ps.push_back(torch::zeros({n}).requires_grad_());
  return ps;
}

// Trains `steps` synchronized steps with `hook` (null: the default); checks every
// gradient against `want` within `tol`.
void check_hook(int n, const std::function<CommHookPtr(const ProcessGroupPtr&)>& make,
                double tol, bool average = true, bool view = false) {
  run_gloo_world(n, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params();
    ReducerOptions o;
    o.bucket_cap_bytes = 256;  // several buckets
    o.gradient_as_bucket_view = view;
    Reducer red(ps, pg, o);
    if (make) red.register_comm_hook(make(pg));
    const double local = 1.1 * (r + 1);
    const double want = average ? 1.1 * (n + 1) / 2.0 : local;
    for (int s = 0; s < 3; ++s) {
      for (auto p : ps) p.mutable_grad() = at::Tensor();
      at::Tensor loss = torch::zeros({});
      for (auto& p : ps) loss = loss + (p * local).sum();
      red.prepare_for_backward(true, 1.0, {loss});
      loss.backward();
      red.finalize();
      for (size_t i = 0; i < ps.size(); ++i) {
        const auto& g = ps[i].grad();
        ASSERT_EQ(g.scalar_type(), at::kFloat);
        EXPECT_NEAR(g.min().item<double>(), want, tol) << "rank " << r << " param " << i;
        EXPECT_NEAR(g.max().item<double>(), want, tol) << "rank " << r << " param " << i;
      }
    }
  });
}

TEST(DefaultHooks, AllreduceHookAverages) {
  for (int n = 1; n <= 3; ++n) check_hook(n, [](const ProcessGroupPtr&) { return allreduce_hook(); }, 1e-6);
  // An explicit group as the state.
  check_hook(2, [](const ProcessGroupPtr& pg) { return allreduce_hook(pg); }, 1e-6);
}

TEST(DefaultHooks, Fp16CompressWithinHalfPrecision) {
  for (bool view : {false, true})
    check_hook(3, [](const ProcessGroupPtr&) { return fp16_compress_hook(); }, 2.2 * 1e-3, true, view);
}

TEST(DefaultHooks, Bf16CompressWithinBfloat16Precision) {
  // Gloo has no bfloat16 sum in torch 1.13: see detail::allreduce_sum.
  for (bool view : {false, true})
    check_hook(3, [](const ProcessGroupPtr&) { return bf16_compress_hook(); }, 2.2 * 8e-3, true, view);
}

TEST(DefaultHooks, CompressWrappersAroundAllreduce) {
  check_hook(2, [](const ProcessGroupPtr&) { return fp16_compress_wrapper(allreduce_hook()); },
             1.65 * 1e-3);
  check_hook(2, [](const ProcessGroupPtr&) { return bf16_compress_wrapper(allreduce_hook()); },
             1.65 * 8e-3, true, true);
  check_hook(2, [](const ProcessGroupPtr&) {
    return bf16_compress_wrapper(fp16_compress_wrapper(allreduce_hook()));
  }, 1.65 * 8e-3);
}

TEST(DefaultHooks, NoopLeavesLocalGradients) {
  check_hook(2, [](const ProcessGroupPtr&) { return noop_hook(); }, 1e-6, /*average=*/false);
}

TEST(DefaultHooks, Bf16SumOnGlooMatchesFloatSum) {
  run_gloo_world(3, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto t = torch::arange(0, 40, at::kFloat).mul(0.25).add(r).to(at::kBFloat16);
    auto fut = detail::allreduce_sum(pg, t);
    wait_future(fut, 10, "bf16 sum");
    auto want = torch::arange(0, 40, at::kFloat).mul(0.75).add(3);
    EXPECT_TRUE(torch::allclose(tensor_of(fut->value(), "sum").to(at::kFloat), want, 1e-2, 1e-2));
    EXPECT_TRUE(torch::allclose(t.to(at::kFloat), want, 1e-2, 1e-2)) << "not in place";
  });
}

// A constant gradient g > 0 quantizes to 255 with scale g / 255 and zero point 0, so
// the dequantized mean is the exact mean up to float32 rounding. Several buckets (two
// allgathers each, the second after waiting for the first) on 1-3 ranks.
TEST(QuantizationHooks, PerTensorAndPerChannelAverage) {
  for (int n = 1; n <= 3; ++n) {
    check_hook(n, [](const ProcessGroupPtr&) { return quantization_pertensor_hook(); }, 1e-5);
    check_hook(n, [](const ProcessGroupPtr&) { return quantization_perchannel_hook({}, 7); },
               1e-5);
  }
  check_hook(2, [](const ProcessGroupPtr& pg) { return quantization_perchannel_hook(pg); }, 1e-5);
  EXPECT_THROW(quantization_perchannel_hook({}, 0), ConfigError);
}

TEST(Builtin, NamesAndErrors) {
  EXPECT_EQ(builtin_hook_names().size(), 10u);
  for (const auto& name : builtin_hook_names()) {
    auto h = is_wrapper(name) ? make_builtin_hook(name, {}, allreduce_hook())
                              : make_builtin_hook(name);
    EXPECT_EQ(h->name().substr(0, name.size()), name);
  }
  try {
    make_builtin_hook("powersgd");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "smp: built-in hook 'powersgd' is not one of {allreduce, "
                           "batched_powerSGD, bf16_compress, bf16_compress_wrapper, "
                           "fp16_compress, fp16_compress_wrapper, noop, powerSGD, "
                           "quantization_perchannel, quantization_pertensor}");
  }
  EXPECT_THROW(make_builtin_hook("fp16_compress_wrapper"), ConfigError);
  EXPECT_THROW(make_builtin_hook("allreduce", {}, noop_hook()), ConfigError);
}

}  // namespace
}  // namespace smp::hooks
