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

// Note [Zero gradients stay]: a gradient of zeros (zero_grad(set_to_none=False)) is not
// set aside: the step adds to it and the sum runs on it, so no second tensor exists, and
// its bits equal those of the set-aside path, +0 + the sum (signed zeros included).
TEST(TiedGradients, ZeroGradientsStayInPlaceWithTheSameBits) {
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr& pg, const compat::StorePtr&) {
    auto bits = [](const at::Tensor& t) { return t.view(at::kInt); };
    auto w = at::zeros({4}).set_requires_grad(true);
    TiedGradients tied({{"w", w, pg}}, 20);
    // This step's contributions, -0.0 included: rank 0 {-0, -0, 1.5, 0.1}, rank 1
    // {-0, +0, -2, 0.2}.
    const auto mine = r == 0 ? at::tensor({-0.0f, -0.0f, 1.5f, 0.1f})
                             : at::tensor({-0.0f, 0.0f, -2.0f, 0.2f});
    const auto other = r == 0 ? at::tensor({-0.0f, 0.0f, -2.0f, 0.2f})
                              : at::tensor({-0.0f, -0.0f, 1.5f, 0.1f});
    const auto set_aside = at::zeros({4}).add_(mine + other);  // +0 + the holders' sum

    w.mutable_grad() = at::zeros({4});
    const void* storage = w.grad().data_ptr();
    tied.begin_step();
    ASSERT_TRUE(w.grad().defined());
    w.mutable_grad().add_(mine);  // as AccumulateGrad adds to a defined .grad
    tied.sum();
    EXPECT_EQ(w.grad().data_ptr(), storage) << "a second gradient tensor";
    EXPECT_TRUE(bits(w.grad()).equal(bits(set_aside))) << w.grad() << set_aside;
    EXPECT_EQ(bits(w.grad())[0].item<int>(), 0) << "-0 + -0 summed onto +0 is +0";

    // restore() zeroes it again: a failed step's contribution is dropped.
    w.mutable_grad().zero_();
    tied.begin_step();
    w.mutable_grad().add_(mine);
    tied.restore();
    EXPECT_EQ(w.grad().data_ptr(), storage);
    EXPECT_TRUE(bits(w.grad()).equal(bits(at::zeros({4}))));

    // Not all zero bits (a -0.0): set aside as any accumulated gradient.
    w.mutable_grad() = at::tensor({0.0f, -0.0f, 0.0f, 0.0f});
    tied.begin_step();
    EXPECT_FALSE(w.grad().defined());
    tied.restore();
    EXPECT_EQ(bits(w.grad())[1].item<int>(), bits(at::tensor({-0.0f}))[0].item<int>());
  });
}

}  // namespace
}  // namespace smp
