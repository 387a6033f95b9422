// The pipeline's serving and driving (smp_core/dispatch.cpp: Note [Serving]) over real
// P2P engines on loopback: ranks are threads, tasks are threads, no mocks. The
// dispatcher's other parts have tests of their own: plan_execution_test.cpp,
// gradient_order_test.cpp, served_backward_test.cpp, step_end_test.cpp,
// dispatch_stats_test.cpp.
#include "smp_core/dispatch.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "../common/dispatch_helpers.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using namespace testing;

TEST(Dispatch, ServesEveryRequestOnOneLeaderAndDrivesInOrderWithinTheWindow) {
  constexpr int64_t kMbs = 7;
  run_p2p_world(2, "dispatch", 20, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    std::mutex mu;
    std::set<std::thread::id> handler_threads;
    std::vector<std::pair<int64_t, int32_t>> served;
    Dispatcher d(p2p, schedule(PlanKind::kInterleaved, kMbs, 2),
                 [&](const Message& req) {
                   std::lock_guard<std::mutex> lock(mu);
                   handler_threads.insert(std::this_thread::get_id());
                   served.emplace_back(req.mb, req.kind);
                   return answer_of(req);
                 },
                 spawn_thread);
    d.begin_step(kMbs);
    if (r == 0) {
      std::atomic<int> in_flight{0}, max_in_flight{0};
      std::vector<int64_t> started;
      d.drive([&](int64_t mb) {
        {
          std::lock_guard<std::mutex> lock(mu);
          started.push_back(mb);
        }
        int now = ++in_flight;
        for (int m = max_in_flight; now > m && !max_in_flight.compare_exchange_weak(m, now);) {}
        p2p->send(1, make(mb, 10 + mb, kRequest, {at::full({4}, float(mb))}));
        Message out = d.wait(mb, 10 + mb, kResponse, false, "the forward answer");
        EXPECT_TRUE(out.tensors.at(0).equal(at::full({4}, 2.f * mb)));
        p2p->send(1, make(mb, 10 + mb, kBackwardRequest, {at::full({4}, float(mb))}));
        Message back = d.wait(mb, 10 + mb, kBackwardResponse, true, "the backward answer");
        EXPECT_EQ(back.kind, kBackwardResponse);
        EXPECT_TRUE(back.tensors.at(0).equal(at::full({4}, 3.f * mb)));
        --in_flight;
      });
      EXPECT_LE(max_in_flight.load(), 3);  // active_microbatches
      EXPECT_EQ(started, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
      Message end = make(-1, 0, kStepEnd);
      end.meta = "done";
      p2p->send(1, end);
    } else {
      Message end = d.serve_step();
      EXPECT_EQ(end.kind, kStepEnd);
      EXPECT_EQ(end.meta, "done");
      EXPECT_EQ(served.size(), 2u * kMbs);
      EXPECT_EQ(handler_threads.size(), 1u);  // no nested call: the leader ran all of them
    }
  });
}

// A request whose module calls back into the caller's rank: while it waits, the lead
// passes to another serving thread, which serves the next microbatch meanwhile. (The
// driver's nested-call handler returns only once microbatch 1 was served: without the
// hand-off, nobody would serve it and the test would time out.)
TEST(Dispatch, NestedCallHandsTheLeadToAnotherThread) {
  std::mutex mu;  // shared by the two ranks (threads of this process)
  std::condition_variable cv;
  bool mb1_served = false;
  std::map<int64_t, std::thread::id> thread_of;
  run_p2p_world(2, "dispatch", 20, [&](int r, const std::shared_ptr<P2PEngine>& p2p) {
    std::unique_ptr<Dispatcher> d;
    auto handler = [&](const Message& req) -> Message {
      if (r == 0) {  // the nested call's module, on the driver
        std::unique_lock<std::mutex> lock(mu);
        EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return mb1_served; }));
        return make(0, 0, kResponse, {req.tensors.at(0) + 1});
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        thread_of[req.mb] = std::this_thread::get_id();
      }
      if (req.mb == 0) {  // calls a module on pp rank 0 and waits for it
        p2p->send(0, make(0, 99, kRequest, {req.tensors.at(0)}));
        Message inner = d->wait(0, 99, kResponse, false, "the nested call's answer");
        return make(0, 0, kResponse, {inner.tensors.at(0) * 2});
      }
      std::lock_guard<std::mutex> lock(mu);
      mb1_served = true;
      cv.notify_all();
      return answer_of(req);
    };
    d = std::make_unique<Dispatcher>(p2p, schedule(PlanKind::kInterleaved, 2, 2), handler,
                                     spawn_thread);
    if (r == 0) {
      d->begin_step(1);
      d->drive([&](int64_t mb) {  // one task sends both microbatches' requests
        p2p->send(1, make(0, 0, kRequest, {at::full({2}, 0.f)}));
        p2p->send(1, make(1, 1, kRequest, {at::full({2}, 1.f)}));
        EXPECT_TRUE(d->wait(0, 0, kResponse, false, "mb 0").tensors.at(0).equal(at::full({2}, 2.f)));
        EXPECT_TRUE(d->wait(1, 1, kResponse, false, "mb 1").tensors.at(0).equal(at::full({2}, 2.f)));
      });
      p2p->send(1, make(-1, 0, kStepEnd));
    } else {
      d->begin_step(2);
      EXPECT_EQ(d->serve_step().kind, kStepEnd);
      EXPECT_NE(thread_of.at(0), thread_of.at(1));
    }
  });
}

// "simple": every forward finishes before any microbatch's backward starts.
TEST(Dispatch, SimpleScheduleRunsEveryForwardBeforeAnyBackward) {
  run_p2p_world(1, "dispatch", 20, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    std::mutex mu;
    std::vector<std::string> events;
    Dispatcher d(p2p, schedule(PlanKind::kSimple, 4, 1), answer_of, spawn_thread);
    d.begin_step(4);
    d.drive([&](int64_t mb) {
      {
        std::lock_guard<std::mutex> lock(mu);
        events.push_back("F" + std::to_string(mb));
      }
      d.forward_finished(mb);
      d.wait_all_forwards(mb);
      std::lock_guard<std::mutex> lock(mu);
      events.push_back("B" + std::to_string(mb));
    });
    ASSERT_EQ(events.size(), 8u);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(events[i][0], 'F') << i;
    for (int i = 4; i < 8; ++i) EXPECT_EQ(events[i][0], 'B') << i;
  });
}

// A request to oneself (a module of this rank called from a task of this rank's) is run
// by the waiting task itself.
TEST(Dispatch, WaitingTaskRunsItsOwnMicrobatchRequests) {
  run_p2p_world(1, "dispatch", 20, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    std::thread::id handler_thread, task_thread;
    Dispatcher d(p2p, schedule(PlanKind::kInterleaved, 1, 1),
                 [&](const Message& req) {
                   handler_thread = std::this_thread::get_id();
                   return answer_of(req);
                 },
                 spawn_thread);
    d.begin_step(1);
    d.drive([&](int64_t mb) {
      task_thread = std::this_thread::get_id();
      p2p->send(0, make(mb, 5, kRequest, {at::ones({3})}));
      Message out = d.wait(mb, 5, kResponse, false, "own answer");
      EXPECT_TRUE(out.tensors.at(0).equal(at::full({3}, 2.f)));
    });
    EXPECT_EQ(handler_thread, task_thread);
  });
}

// A handler that throws ends the step on its rank at once (not at the timeout: both
// engines wait 60 s) and gets its caller an ERROR answer naming the failure.
TEST(Dispatch, FailingHandlerEndsServingAndAnswersTheCallerWithAnError) {
  run_p2p_world(2, "dispatch", 60, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    Dispatcher d(p2p, schedule(PlanKind::kInterleaved, 1, 2),
                 [](const Message&) -> Message { throw std::runtime_error("handler broke"); },
                 spawn_thread);
    d.begin_step(1);
    if (r == 0) {
      d.drive([&](int64_t mb) {
        p2p->send(1, make(mb, 1, kRequest, {at::ones({1})}));
        Message m = d.wait(mb, 1, kResponse, false, "the output of 'layer' from pp rank 1");
        EXPECT_EQ(m.kind, kError);
        EXPECT_NE(m.meta.find("pp rank 1 could not run a request: handler broke"),
                  std::string::npos) << m.meta;
      });
    } else {
      try {
        d.serve_step();
        ADD_FAILURE() << "no error";
      } catch (const TimeoutError& e) {
        ADD_FAILURE() << "waited for the timeout: " << e.what();
      } catch (const std::runtime_error& e) {
        EXPECT_EQ(std::string(e.what()), "handler broke");
      }
    }
  });
}

// A step longer than twice the timeout, with one thread leading all along (no nested
// call), is fine: only waits for messages are bounded, each by the timeout (1 s here).
TEST(Dispatch, LongStepWithOneLeaderIsNotATimeout) {
  run_p2p_world(2, "dispatch", 1, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    Dispatcher d(p2p, schedule(PlanKind::kInterleaved, 6, 2, 1),
                 [](const Message& req) {
                   std::this_thread::sleep_for(std::chrono::milliseconds(400));
                   return answer_of(req);
                 },
                 spawn_thread);
    d.begin_step(6);
    if (r == 0) {
      d.drive([&](int64_t mb) {
        p2p->send(1, make(mb, mb, kRequest, {at::ones({1})}));
        EXPECT_EQ(d.wait(mb, mb, kResponse, false, "answer").kind, kResponse);
      });
      p2p->send(1, make(-1, 0, kStepEnd));
    } else {
      EXPECT_EQ(d.serve_step().kind, kStepEnd);  // 2.4 s of serving, timeout 1 s
    }
  });
}

}  // namespace
}  // namespace smp
