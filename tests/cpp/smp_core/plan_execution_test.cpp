// The dispatcher's plan execution (smp_core/detail/plan_execution.cpp: Note [Executed
// plan], Note [Forward order]) over real P2P engines on loopback: the plan recorded
// from a step's calls, executed by every rank in its order, left when a step differs;
// and the forward order of a deterministic step without a plan. Ranks are threads, no
// mocks.
#include "smp_core/dispatch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "../common/dispatch_helpers.h"

namespace smp {
namespace {

using namespace testing;

// Step 1 runs without a list (Note [Order without a list]) and records its calls (path 0, 1, 0); step 2
// executes the plan they describe on both ranks, every action in the plan's order; in
// step 3 microbatch 1 makes one call more than planned, and the driver leaves the plan
// (the step still ends well); step 3's calls were not uniform, so step 4 has no plan.
TEST(PlanExecution, ExecutesTheRecordedPlanAndLeavesItWhenAStepDiffers) {
  constexpr int64_t kMbs = 4;
  run_p2p_world(2, "plan_exec", 20, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    Dispatcher d(p2p, schedule(PlanKind::kInterleaved, kMbs, 2, 2), answer_of, spawn_thread);
    std::vector<std::string> first_ran;
    for (int64_t step = 1; step <= 4; ++step) {
      d.begin_step(kMbs);
      p2p->begin_step(step);
      if (r == 0) {
        d.drive([&](int64_t mb) {
          const float v = static_cast<float>(mb + 1);
          auto forward = [&](int64_t call) {
            Message out = d.request_native(1, make(mb, call, kRequest, {at::full({2}, v)}),
                                           kResponse, false, "the forward answer");
            ASSERT_EQ(out.kind, kResponse);
            EXPECT_TRUE(out.tensors.at(0).equal(at::full({2}, 2 * v)));
          };
          forward(mb);
          if (step == 3 && mb == 1) forward(100);  // not in the plan
          Message in = d.request_native(1, make(mb, mb, kBackwardRequest, {at::full({2}, v)}),
                                        kBackwardResponse, true, "the backward answer");
          ASSERT_EQ(in.kind, kBackwardResponse);
          EXPECT_TRUE(in.tensors.at(0).equal(at::full({2}, 3 * v)));
        });
        p2p->send(1, make(-1, 0, kStepEnd));
      } else {
        EXPECT_EQ(d.serve_step().kind, kStepEnd);
      }
      const auto s = d.stats();
      const auto planned = d.planned_actions();
      if (step == 1) {
        // Note [Order without a list]: no plan, and what ran is recorded in the plan's
        // vocabulary, without hops.
        EXPECT_EQ(s.planned_steps, 0);
        EXPECT_TRUE(planned.empty());
        first_ran = d.executed_actions();
        EXPECT_EQ(d.plan_text().rfind("order without a list (interleaved), this rank's actions "
                                      "as they ran:\npp ", 0), 0u) << d.plan_text();
      }
      if (step == 2) {
        EXPECT_EQ(s.planned_steps, 1) << "rank " << r;
        EXPECT_EQ(s.new_plans, 1);
        EXPECT_EQ(s.plan_fallbacks, 0);
        // Each microbatch's F and B here; on the driver its F of hop 2 too (that hop's
        // backward follows its forward in one admission).
        EXPECT_EQ(planned.size(), static_cast<size_t>((r == 0 ? 3 : 2) * kMbs)) << "rank " << r;
        EXPECT_EQ(d.executed_actions(), planned) << "rank " << r;
        EXPECT_EQ(d.plan_text().rfind("plan interleaved", 0), 0u) << d.plan_text();
        // Step 1 ran the same actions as the plan holds, in its own order.
        std::vector<std::string> without_hops;
        for (const auto& a : planned) without_hops.push_back(a.substr(0, a.find('.')));
        std::sort(without_hops.begin(), without_hops.end());
        std::sort(first_ran.begin(), first_ran.end());
        EXPECT_EQ(first_ran, without_hops) << "rank " << r;
      }
      if (step == 3) {
        EXPECT_EQ(s.planned_steps, 2) << "rank " << r;
        EXPECT_EQ(s.new_plans, 1);  // the same plan again
        if (r == 0) EXPECT_EQ(s.plan_fallbacks, 1);
        EXPECT_NE(d.executed_actions(), planned) << "rank " << r;
        // The plan, then what ran after the step left it.
        if (r == 0)
          EXPECT_NE(d.plan_text().find("after the step left its plan"), std::string::npos)
              << d.plan_text();
      }
      if (step == 4 && r == 0) EXPECT_EQ(s.planned_steps, 2);
    }
  });
}

// Note [Forward order]: microbatch 1's answer comes first (pp rank 2 answers at once,
// pp rank 1 after 300 ms), yet in a deterministic step microbatch 1 starts its second
// forward action only after microbatch 0 started its own (one wait); outside one it
// starts at once.
TEST(PlanExecution, DeterministicStepStartsForwardActionsInMicrobatchOrder) {
  for (const bool deterministic : {true, false}) {
    run_p2p_world(3, "fwd_order", 20, [&](int r, const std::shared_ptr<P2PEngine>& p2p) {
      Dispatcher d(p2p, schedule(PlanKind::kInterleaved, 2, 3),
                   [r](const Message& req) {
                     if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
                     return answer_of(req);
                   },
                   spawn_thread);
      d.begin_step(2, deterministic);
      if (r == 0) {
        std::mutex mu;
        std::vector<int64_t> second_actions;  // microbatches, as their second action began
        d.drive([&](int64_t mb) {
          const int dst = mb == 0 ? 1 : 2;
          p2p->send(dst, make(mb, mb, kRequest, {at::ones({1})}));
          ASSERT_EQ(d.wait(mb, mb, kResponse, false, "the forward answer").kind, kResponse);
          std::lock_guard<std::mutex> lock(mu);
          second_actions.push_back(mb);
        });
        for (int dst : {1, 2}) p2p->send(dst, make(-1, 0, kStepEnd));
        EXPECT_EQ(second_actions, deterministic ? (std::vector<int64_t>{0, 1})
                                                : (std::vector<int64_t>{1, 0}));
        EXPECT_EQ(d.stats().forward_order_waits, deterministic ? 1 : 0);
      } else {
        EXPECT_EQ(d.serve_step().kind, kStepEnd);
      }
    });
  }
}

}  // namespace
}  // namespace smp
