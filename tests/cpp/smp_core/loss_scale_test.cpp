// Note [One overflow decision]: the loss scaler's rules (static; dynamic with hysteresis,
// consecutive or not) against a step-by-step expectation worked out here, its argument
// checks, and the overflow check's agreement over a real Gloo group (ranks as threads).
#include "smp_core/loss_scale.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "../common/gloo_world.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using testing::run_gloo_world;

TEST(LossScaler, StaticNeverMoves) {
  LossScaler s = LossScaler::fixed(128);
  EXPECT_FALSE(s.is_dynamic());
  s.update(true);
  s.update(false);
  EXPECT_EQ(s.scale(), 128);
  EXPECT_THROW(LossScaler::fixed(0), ConfigError);
  EXPECT_THROW(LossScaler::fixed(-1), ConfigError);
}

TEST(LossScaler, HalvesOnOverflowAndGrowsAfterAWindow) {
  LossScaler s = LossScaler::dynamic({{"init_scale", 1024}, {"scale_window", 3}});
  EXPECT_EQ(s.scale(), 1024);
  s.update(false);  // iter 0: (0 - -1) % 3 != 0
  s.update(false);  // iter 1
  EXPECT_EQ(s.scale(), 1024);
  s.update(false);  // iter 2: (2 - -1) % 3 == 0: grows
  EXPECT_EQ(s.scale(), 2048);
  s.update(true);   // iter 3: overflow, delayed_shift 1: halves
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.state().last_overflow_iter, 3);
  s.update(false);  // 4: (4-3)%3
  s.update(false);  // 5
  EXPECT_EQ(s.scale(), 1024);
  s.update(false);  // 6: (6-3)%3 == 0
  EXPECT_EQ(s.scale(), 2048);
}

TEST(LossScaler, MinScaleBoundsTheShift) {
  LossScaler s = LossScaler::dynamic({{"init_scale", 4}, {"min_scale", 2}});
  s.update(true);
  EXPECT_EQ(s.scale(), 2);
  s.update(true);
  EXPECT_EQ(s.scale(), 2);
}

TEST(LossScaler, HysteresisAbsorbsOverflowsBeforeShifting) {
  // delayed_shift 3: two overflows are absorbed, the third shifts; without
  // consecutive_hysteresis the allowance comes back only when the scale grows.
  LossScaler s = LossScaler::dynamic(
      {{"init_scale", 64}, {"delayed_shift", 3}, {"scale_window", 100}});
  s.update(true);
  EXPECT_EQ(s.scale(), 64);
  s.update(false);  // not a window's end: the allowance stays used
  s.update(true);
  EXPECT_EQ(s.scale(), 64);
  EXPECT_EQ(s.state().hysteresis, 1);
  s.update(true);
  EXPECT_EQ(s.scale(), 32);
  s.update(true);  // hysteresis stays 1: every further overflow shifts
  EXPECT_EQ(s.scale(), 16);
}

TEST(LossScaler, ConsecutiveHysteresisResetsOnAGoodStep) {
  LossScaler s = LossScaler::dynamic({{"init_scale", 64}, {"delayed_shift", 2},
                                      {"scale_window", 100}, {"consecutive_hysteresis", 1}});
  s.update(true);   // absorbed
  s.update(false);  // a good step gives the allowance back
  s.update(true);   // absorbed again
  EXPECT_EQ(s.scale(), 64);
  s.update(true);   // two in a row: shifts
  EXPECT_EQ(s.scale(), 32);
}

TEST(LossScaler, RefusesBadArguments) {
  EXPECT_THROW(LossScaler::dynamic({{"init_scal", 2}}), ConfigError);
  EXPECT_THROW(LossScaler::dynamic({{"init_scale", 0}}), ConfigError);
  EXPECT_THROW(LossScaler::dynamic({{"scale_factor", 1}}), ConfigError);
  EXPECT_THROW(LossScaler::dynamic({{"scale_window", 0.5}}), ConfigError);
  EXPECT_THROW(LossScaler::dynamic({{"delayed_shift", 0}}), ConfigError);
  EXPECT_THROW(LossScaler::dynamic({{"consecutive_hysteresis", 2}}), ConfigError);
  EXPECT_THROW(LossScaler::dynamic({{"init_scale", 1}, {"min_scale", 2}}), ConfigError);
  try {
    LossScaler::dynamic({{"window", 2}});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'window'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("scale_window"), std::string::npos) << e.what();
  }
}

TEST(LossScaler, StateRoundTrips) {
  LossScaler a = LossScaler::dynamic({{"init_scale", 8}, {"delayed_shift", 2}});
  a.update(true);
  LossScaler b = LossScaler::dynamic({{"init_scale", 8}, {"delayed_shift", 2}});
  b.set_state(a.state());
  a.update(true);
  b.update(true);
  EXPECT_EQ(a.scale(), b.scale());
  EXPECT_EQ(b.scale(), 4);
}

TEST(OverflowCheck, FindsInfAndNanInAnyDtype) {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble}) {
    auto g = at::ones({5}, at::TensorOptions().dtype(dtype));
    EXPECT_FALSE(OverflowCheck::any_nonfinite({g, at::Tensor()}));
    g[2] = std::numeric_limits<float>::infinity();
    EXPECT_TRUE(OverflowCheck::any_nonfinite({g}));
    g[2] = std::nan("");
    EXPECT_TRUE(OverflowCheck::any_nonfinite({g}));
  }
  // Large finite values do not count: the sum is in double.
  auto big = at::full({1000}, 3e38, at::TensorOptions().dtype(at::kFloat));
  EXPECT_FALSE(OverflowCheck::any_nonfinite({big}));
  auto half_max = at::full({1000}, 65504.0, at::TensorOptions().dtype(at::kHalf));
  EXPECT_FALSE(OverflowCheck::any_nonfinite({half_max}));
}

TEST(OverflowCheck, EveryRankGetsTheSameAnswer) {
  run_gloo_world(3, [](int r, const compat::ProcessGroupPtr& pg, const compat::StorePtr&) {
    auto p = at::zeros({4}).set_requires_grad(true);
    OverflowCheck check({p}, pg, 20);
    EXPECT_FALSE(check.last().has_value());
    p.mutable_grad() = at::ones({4});
    if (r == 2) p.mutable_grad()[1] = std::numeric_limits<float>::infinity();
    EXPECT_TRUE(check.run()) << "rank " << r;
    EXPECT_EQ(check.take(), std::optional<bool>(true));
    EXPECT_FALSE(check.last().has_value());
    p.mutable_grad() = at::ones({4});
    if (r == 0) p.mutable_grad() = at::Tensor();  // a rank without gradients
    EXPECT_FALSE(check.run()) << "rank " << r;
    EXPECT_EQ(check.runs(), 2);
  });
}

}  // namespace
}  // namespace smp
