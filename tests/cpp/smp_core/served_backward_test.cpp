// The dispatcher's served backward (smp_core/detail/served_backward.cpp: Note [Served
// backward], Note [Zero bubble at run time]) over real P2P engines on loopback: kept
// calls' backward runs in C++, whole or split into I and W. Ranks are threads, no mocks.
#include "smp_core/dispatch.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>

#include "../common/dispatch_helpers.h"
#include "smp_core/errors.h"
#include "smp_core/remote_call.h"

namespace smp {
namespace {

using namespace testing;

// The handler of a call kept for a backward served in C++: y = 2xw on the request's first
// tensor x, a leaf kept with y; answers y.
Message keep_doubled(Dispatcher& d, const Message& req, const at::Tensor& w) {
  EXPECT_EQ(req.kind, kRequest) << "a kept call's backward reached the handler";
  at::Tensor x = req.tensors.at(0).clone().set_requires_grad(true);
  at::Tensor y = x * w * 2;
  d.keep_for_backward(req.src, req.mb, req.call_id, {x}, {y});
  return make(0, 0, kResponse, {y.detach()});
}

// Note [Served backward] and Note [Arming at the first backward]: a call whose forward
// kept its input leaf and output is served backward in C++ (the handler never sees a
// backward request), its input gradient comes back, its parameter's gradients sum over
// the microbatches, and the step's arm runs once, before the first accumulation.
TEST(ServedBackward, KeptCallsAreServedInCppAndTheArmRunsOnce) {
  constexpr int64_t kMbs = 4;
  run_p2p_world(2, "served", 20, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    at::Tensor w = at::ones({4}).set_requires_grad(true);
    std::atomic<int> handled{0}, armed{0};
    std::atomic<bool> grad_before_arm{false};
    std::shared_ptr<Dispatcher> d;
    d = std::make_shared<Dispatcher>(
        p2p, schedule(PlanKind::kInterleaved, kMbs, 2),
        [&](const Message& req) {
          ++handled;
          return keep_doubled(*d, req, w);
        },
        spawn_thread);
    if (r == 1) {
      d->order_gradients({w});
      d->arm_at_first_backward([&] {
        ++armed;
        grad_before_arm = w.grad().defined();
      });
    }
    d->begin_step(kMbs);
    if (r == 0) {
      d->drive([&](int64_t mb) {
        const float v = static_cast<float>(mb + 1);
        p2p->send(1, make(mb, mb, kRequest, {at::full({4}, v)}));
        Message out = d->wait(mb, mb, kResponse, false, "the forward answer");
        EXPECT_TRUE(out.tensors.at(0).equal(at::full({4}, 2 * v)));
        Message back = make(mb, mb, kBackwardRequest, {at::full({4}, 1.f)});
        back.meta = gradient_flags({true});
        p2p->send(1, back);
        Message in = d->wait(mb, mb, kBackwardResponse, true, "the backward answer");
        ASSERT_EQ(in.kind, kBackwardResponse);
        EXPECT_EQ(parse_gradient_flags(in.meta, 1, "x"), std::vector<bool>{true});
        EXPECT_TRUE(in.tensors.at(0).equal(at::full({4}, 2.f)));  // d(2xw)/dx
      });
      p2p->send(1, make(-1, 0, kStepEnd));
    } else {
      EXPECT_EQ(d->serve_step().kind, kStepEnd);
      EXPECT_EQ(handled.load(), 4);
      EXPECT_EQ(armed.load(), 1);
      EXPECT_FALSE(grad_before_arm.load());
      EXPECT_TRUE(w.grad().equal(at::full({4}, 2.f * (1 + 2 + 3 + 4))));
      EXPECT_EQ(d->stats().native_backwards, 4);
      d->arm_now();  // it ran: not again
      EXPECT_EQ(armed.load(), 1);
      EXPECT_TRUE(d->disarm());
      EXPECT_FALSE(d->disarm());
    }
  });
}

// A served backward that fails answers the caller with the failure encoder's error and
// the rank goes on serving; an arm that never ran is reported as such.
TEST(ServedBackward, FailingServedBackwardAnswersWithTheEncodedError) {
  run_p2p_world(2, "served_fail", 20, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    std::shared_ptr<Dispatcher> d;
    d = std::make_shared<Dispatcher>(
        p2p, schedule(PlanKind::kInterleaved, 2, 2),
        [&](const Message& req) {
          at::Tensor x = req.tensors.at(0).clone();  // no graph: its backward must fail
          d->keep_for_backward(req.src, req.mb, req.call_id, {x}, {x * 2});
          return make(0, 0, kResponse, {x});
        },
        spawn_thread);
    d->set_failure_encoder([](std::exception_ptr e, int64_t, bool) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        return std::string("encoded: ") + ex.what();
      }
    });
    int arms = 0;
    d->arm_at_first_backward([&] { ++arms; });
    d->begin_step(2);
    if (r == 0) {
      d->drive([&](int64_t mb) {
        p2p->send(1, make(mb, mb, kRequest, {at::ones({2})}));
        d->wait(mb, mb, kResponse, false, "the forward answer");
        Message back = make(mb, mb, kBackwardRequest, {at::ones({2})});
        back.meta = gradient_flags({true});
        p2p->send(1, back);
        Message in = d->wait(mb, mb, kBackwardResponse, true, "the backward answer");
        EXPECT_EQ(in.kind, kError);
        EXPECT_EQ(in.meta.rfind("encoded: ", 0), 0u) << in.meta;
      });
      p2p->send(1, make(-1, 0, kStepEnd));
    } else {
      EXPECT_EQ(d->serve_step().kind, kStepEnd);  // both microbatches were answered
      EXPECT_EQ(d->stats().native_backwards, 2);
    }
    EXPECT_EQ(arms, 0);
    EXPECT_FALSE(d->disarm());
  });
}

// Note [Zero bubble at run time]: under zero_bubble the first step runs in the dynamic
// order, each kept call's backward whole; the next step executes the plan the first
// step's calls describe (path 0, 1, 0), and pp rank 1 splits each served backward into
// I, answered at once, and W, run at its turn in the plan. The gradients are the same
// either way, every W runs, and the driver ends the step only after rank 1's word that
// its W are over (the step would time out otherwise).
TEST(ServedBackward, ZeroBubbleSplitsKeptCallsIntoIAndW) {
  constexpr int64_t kMbs = 4;
  run_p2p_world(2, "zero_bubble", 20, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    at::Tensor w = at::ones({4}).set_requires_grad(true);
    std::shared_ptr<Dispatcher> d;
    d = std::make_shared<Dispatcher>(
        p2p, schedule(PlanKind::kZeroBubble, kMbs, 2),
        [&](const Message& req) { return keep_doubled(*d, req, w); },
        spawn_thread);
    d->record_spans(true);
    for (int64_t step = 1; step <= 2; ++step) {
      d->begin_step(kMbs);
      p2p->begin_step(step);
      if (r == 0) {
        d->drive([&](int64_t mb) {
          const float v = static_cast<float>(mb + 1);
          Message out = d->request_native(1, make(mb, mb, kRequest, {at::full({4}, v)}),
                                          kResponse, false, "the forward answer");
          ASSERT_EQ(out.kind, kResponse);
          EXPECT_TRUE(out.tensors.at(0).equal(at::full({4}, 2 * v)));
          Message back = make(mb, mb, kBackwardRequest, {at::full({4}, 1.f)});
          back.meta = gradient_flags({true});
          Message in = d->request_native(1, back, kBackwardResponse, true, "the backward answer");
          ASSERT_EQ(in.kind, kBackwardResponse);
          EXPECT_TRUE(in.tensors.at(0).equal(at::full({4}, 2.f)));  // d(2xw)/dx
        });
        p2p->send(1, make(-1, 0, kStepEnd));
        EXPECT_EQ(d->stats().planned_steps, step - 1);
      } else {
        EXPECT_EQ(d->serve_step().kind, kStepEnd);
        // Every microbatch's weight gradient, whole or from its W: 2 * (1 + 2 + 3 + 4).
        EXPECT_TRUE(w.grad().equal(at::full({4}, 20.f))) << "step " << step;
        w.mutable_grad() = at::Tensor();
        const auto s = d->stats();
        EXPECT_EQ(s.native_backwards, kMbs * step);
        EXPECT_EQ(s.split_backwards, step == 1 ? 0 : kMbs);
        EXPECT_EQ(s.weight_actions, step == 1 ? 0 : kMbs);
        EXPECT_EQ(s.planned_steps, step - 1);
        EXPECT_EQ(s.plan_fallbacks, 0);
        // A span per served backward, and per W once they split.
        EXPECT_EQ(d->take_spans().size(), static_cast<size_t>(step == 1 ? kMbs : 2 * kMbs));
      }
    }
  });
}

}  // namespace
}  // namespace smp
