#include "smp_core/task_rng.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "smp_core/errors.h"

namespace smp {
namespace {

// Note [Microbatch random streams]: a derived stream depends only on the step's seed
// and the microbatch; capture/install round-trips the default generator.
TEST(TaskRng, DerivedStreamsDependOnSeedAndMicrobatchOnly) {
  at::manual_seed(3);
  auto draw_from = [](const std::string& state) {
    task_rng::install(state);
    return at::rand({5});
  };
  const std::string a0 = task_rng::derive(42, 0, false), a1 = task_rng::derive(42, 1, false);
  at::rand({100});  // whatever the default generator did meanwhile
  EXPECT_EQ(task_rng::derive(42, 0, false), a0);
  EXPECT_NE(a0, a1);
  EXPECT_NE(task_rng::derive(43, 0, false), a0);
  EXPECT_TRUE(draw_from(a0).equal(draw_from(a0)));
  EXPECT_FALSE(draw_from(a0).equal(draw_from(a1)));
}

TEST(TaskRng, CaptureInstallResumesTheStream) {
  at::manual_seed(7);
  at::rand({3});
  const std::string here = task_rng::capture(false);
  auto next = at::rand({4});
  at::rand({50});
  task_rng::install(here);
  EXPECT_TRUE(at::rand({4}).equal(next));
  EXPECT_EQ(task_rng::capture_like(here).size(), here.size());
  task_rng::install("");  // nothing to install: a no-op
}

TEST(TaskRng, TruncatedStateIsRefused) {
  const std::string state = task_rng::capture(false);
  EXPECT_THROW(task_rng::install(state.substr(0, 10)), std::runtime_error);
  EXPECT_THROW(task_rng::install(state.substr(0, state.size() - 1)), std::runtime_error);
}

TEST(TaskRng, StepSeedsAdvanceTheDefaultGenerator) {
  at::manual_seed(11);
  const uint64_t a = task_rng::draw_step_seed(), b = task_rng::draw_step_seed();
  at::manual_seed(11);
  EXPECT_EQ(task_rng::draw_step_seed(), a);
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace smp
