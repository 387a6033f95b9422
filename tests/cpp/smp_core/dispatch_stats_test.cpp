// The dispatcher's counters (smp_core/detail/dispatch_stats.cpp) over real P2P engines
// on loopback: the Python<->C++ crossings and requests of a step, in closed form.
// Ranks are threads, no mocks.
#include "smp_core/dispatch.h"

#include <gtest/gtest.h>

#include <memory>

#include "../common/dispatch_helpers.h"

namespace smp {
namespace {

using namespace testing;

// A step of 4 microbatches, window 3, each making a forward and a backward call to pp
// rank 1; the even ones through call() (from Python: a crossing each), the odd ones
// through request_native() (from C++: none). Crossings, driver: begin_step 1 + drive 1
// + a thread per window slot 3 + a step body per microbatch 4 + call() 2 * 2 = 13;
// serving rank: begin_step 1 + serve_step 1 + two serving threads 2 + a handler per
// request 8 = 12. C++ threads (set_spawn_crosses(false)) cross nothing: 10 and 10.
TEST(DispatchStats, CrossingsAndRequestsOfAStepInClosedForm) {
  constexpr int64_t kMbs = 4;
  for (const bool spawn_crosses : {true, false}) {
    run_p2p_world(2, "stats", 20, [&](int r, const std::shared_ptr<P2PEngine>& p2p) {
      Dispatcher d(p2p, schedule(PlanKind::kInterleaved, kMbs, 2), answer_of, spawn_thread);
      d.set_spawn_crosses(spawn_crosses);
      d.record_spans(true);  // spans are of served backwards only: none here
      d.begin_step(kMbs);
      if (r == 0) {
        d.drive([&](int64_t mb) {
          const bool python = mb % 2 == 0;
          auto request = [&](Message m, int32_t kind, bool backward) {
            return python ? d.call(1, std::move(m), kind, backward, "an answer")
                          : d.request_native(1, std::move(m), kind, backward, "an answer");
          };
          Message out = request(make(mb, 2 * mb, kRequest, {at::full({1}, 1.f)}), kResponse, false);
          EXPECT_TRUE(out.tensors.at(0).equal(at::full({1}, 2.f)));
          Message in =
              request(make(mb, 2 * mb + 1, kBackwardRequest, {at::full({1}, 1.f)}), kBackwardResponse, true);
          EXPECT_TRUE(in.tensors.at(0).equal(at::full({1}, 3.f)));
        });
        p2p->send(1, make(-1, 0, kStepEnd));
        const auto s = d.stats();
        EXPECT_EQ(s.crossings, spawn_crosses ? 13 : 10);
        EXPECT_EQ(s.requests, 0);
        EXPECT_EQ(s.microbatches, kMbs);
      } else {
        EXPECT_EQ(d.serve_step().kind, kStepEnd);
        const auto s = d.stats();
        EXPECT_EQ(s.crossings, spawn_crosses ? 12 : 10);
        EXPECT_EQ(s.requests, 2 * kMbs);
        EXPECT_EQ(s.microbatches, kMbs);
        EXPECT_GE(s.handler_s, 0.0);
        EXPECT_EQ(s.native_backwards, 0);
      }
      EXPECT_TRUE(d.take_spans().empty());
    });
  }
}

}  // namespace
}  // namespace smp
