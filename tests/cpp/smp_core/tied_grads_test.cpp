// Note [Tied gradient sum]: each holder of a tied parameter ends the step with what it
// had before plus the sum of every holder's contribution; with no contribution anywhere
// it keeps what it had; restore() gives a step's contribution back locally. Real Gloo
// groups on loopback, ranks as threads.
#include "smp_core/tied_grads.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "../common/gloo_world.h"

namespace smp {
namespace {

using testing::run_gloo_world;

TEST(TiedGradients, SumsThisStepsContributionsOverTheHolders) {
  run_gloo_world(3, [](int r, const compat::ProcessGroupPtr& pg, const compat::StorePtr&) {
    auto w = at::zeros({2, 3}).set_requires_grad(true);
    auto b = at::zeros({4}).set_requires_grad(true);
    TiedGradients tied({{"w", w, pg}, {"b", b, pg}}, 20);
    ASSERT_EQ(tied.size(), 2u);

    w.mutable_grad() = at::full({2, 3}, 0.5);  // accumulated before the step
    tied.begin_step();
    EXPECT_FALSE(w.grad().defined());
    w.mutable_grad() = at::full({2, 3}, float(r));     // 0 + 1 + 2
    if (r != 1) b.mutable_grad() = at::full({4}, float(r + 1));  // 1 + 3; rank 1 none
    tied.sum();
    EXPECT_TRUE(w.grad().equal(at::full({2, 3}, 3.5))) << w.grad();
    ASSERT_TRUE(b.grad().defined()) << "rank " << r;  // joined the sum with zeros
    EXPECT_TRUE(b.grad().equal(at::full({4}, 4.0))) << b.grad();

    // A step with no contribution on any holder keeps what was there.
    tied.begin_step();
    tied.sum();
    EXPECT_TRUE(w.grad().equal(at::full({2, 3}, 3.5)));

    // restore(): local, what was set aside comes back and a failed step's un-summed
    // contribution (this holder's alone) is dropped, so the copies stay equal.
    tied.begin_step();
    w.mutable_grad() = at::ones({2, 3});
    tied.restore();
    EXPECT_TRUE(w.grad().equal(at::full({2, 3}, 3.5)));
    EXPECT_TRUE(b.grad().equal(at::full({4}, 4.0)));
  });
}

}  // namespace
}  // namespace smp
