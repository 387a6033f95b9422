// The pipeline's serving and dispatch (smp_core/dispatch.h) over real P2P engines on
// loopback: ranks are threads, tasks are threads, no mocks.
#include "smp_core/dispatch.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "../common/gloo_world.h"
#include "smp_core/errors.h"
#include "smp_core/remote_call.h"

namespace smp {
namespace {

using testing::run_gloo_world;

constexpr uint32_t bit(int kind) { return 1u << kind; }

Message make(int64_t mb, int64_t call, int32_t kind, std::vector<at::Tensor> tensors = {}) {
  Message m;
  m.mb = mb, m.call_id = call, m.kind = kind;
  m.tensors = std::move(tensors);
  return m;
}

Schedule schedule(ScheduleKind kind, int64_t mbs, int64_t stages, int64_t active = 3) {
  return Schedule(ScheduleOptions{kind, mbs, stages, active});
}

// Runs every spawned body on a detached thread of its own; the dispatcher joins them.
void spawn_thread(std::function<void()> body) { std::thread(std::move(body)).detach(); }

// The answer a test handler gives: the request's first tensor times 2 (forward) or 3.
Message answer_of(const Message& req) {
  const bool fwd = req.kind == kRequest;
  return make(0, 0, fwd ? kResponse : kBackwardResponse, {req.tensors.at(0) * (fwd ? 2 : 3)});
}

TEST(Dispatch, ServesEveryRequestOnOneLeaderAndDrivesInOrderWithinTheWindow) {
  constexpr int64_t kMbs = 7;
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "dispatch", r, 2, 20);
    std::mutex mu;
    std::set<std::thread::id> handler_threads;
    std::vector<std::pair<int64_t, int32_t>> served;
    Dispatcher d(p2p, schedule(ScheduleKind::kInterleaved, kMbs, 2),
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
  run_gloo_world(2, [&](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "dispatch", r, 2, 20);
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
    d = std::make_unique<Dispatcher>(p2p, schedule(ScheduleKind::kInterleaved, 2, 2), handler,
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
  run_gloo_world(1, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "dispatch", r, 1, 20);
    std::mutex mu;
    std::vector<std::string> events;
    Dispatcher d(p2p, schedule(ScheduleKind::kSimple, 4, 1), answer_of, spawn_thread);
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
  run_gloo_world(1, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "dispatch", r, 1, 20);
    std::thread::id handler_thread, task_thread;
    Dispatcher d(p2p, schedule(ScheduleKind::kInterleaved, 1, 1),
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
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "dispatch", r, 2, 60);
    Dispatcher d(p2p, schedule(ScheduleKind::kInterleaved, 1, 2),
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
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "dispatch", r, 2, 1);
    Dispatcher d(p2p, schedule(ScheduleKind::kInterleaved, 6, 2, 1),
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

// Note [Served backward] and Note [Arming at the first backward]: a call whose forward
// kept its input leaf and output is served backward in C++ (the handler never sees a
// backward request), its input gradient comes back, its parameter's gradients sum over
// the microbatches, and the step's arm runs once, before the first accumulation.
TEST(Dispatch, KeptCallsAreServedBackwardInCppAndArmOnce) {
  constexpr int64_t kMbs = 4;
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "served", r, 2, 20);
    at::Tensor w = at::ones({4}).set_requires_grad(true);
    std::atomic<int> handled{0}, armed{0};
    std::atomic<bool> grad_before_arm{false};
    std::shared_ptr<Dispatcher> d;
    d = std::make_shared<Dispatcher>(
        p2p, schedule(ScheduleKind::kInterleaved, kMbs, 2),
        [&](const Message& req) {
          ++handled;
          EXPECT_EQ(req.kind, kRequest) << "a kept call's backward reached the handler";
          at::Tensor x = req.tensors.at(0).clone().set_requires_grad(true);
          at::Tensor y = x * w * 2;
          d->keep_for_backward(req.src, req.mb, req.call_id, {x}, {y});
          return make(0, 0, kResponse, {y.detach()});
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
TEST(Dispatch, FailingServedBackwardAnswersWithTheEncodedError) {
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "served_fail", r, 2, 20);
    std::shared_ptr<Dispatcher> d;
    d = std::make_shared<Dispatcher>(
        p2p, schedule(ScheduleKind::kInterleaved, 2, 2),
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

// Note [Step end]: the microbatches' shares reach every pp rank in one kStepEnd, in
// microbatch order whatever order the bodies finished in; a body's error aborts the step
// on every rank instead, the first error only.
TEST(Dispatch, DriveStepSendsOneStepEndOrTheFirstError) {
  constexpr int64_t kMbs = 4;
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "step_end", r, 2, 20);
    Dispatcher d(p2p, schedule(ScheduleKind::kInterleaved, kMbs, 2), answer_of, spawn_thread);
    for (const bool fail : {false, true}) {
      d.begin_step(kMbs);
      p2p->begin_step(fail ? 2 : 1);
      if (r == 0) {
        const bool ended = d.drive_step([&](int64_t mb) {
          // Later microbatches finish first.
          std::this_thread::sleep_for(std::chrono::milliseconds(5 * (kMbs - mb)));
          if (fail && mb >= 1) {  // 1 failed first (its error is sent); 2 and 3 know it did
            Message abort = make(mb, 0, kAbort);
            if (mb == 1) abort.meta = "boom in microbatch 1";
            return abort;
          }
          Message part = make(mb, 0, kStepEnd, std::vector<at::Tensor>(mb, at::full({2}, float(mb))));
          part.meta = std::string(static_cast<size_t>(mb) + 1, static_cast<char>('a' + mb));
          return part;
        });
        EXPECT_EQ(ended, !fail);
        if (fail)  // the driver's own tasks see the abort too
          EXPECT_EQ(p2p->recv(kAny, kAny, bit(kAbort), "the abort").meta, "boom in microbatch 1");
      } else {
        Message end = d.serve_step();
        if (fail) {
          EXPECT_EQ(end.kind, kAbort);
          EXPECT_EQ(end.meta, "boom in microbatch 1");
        } else {
          ASSERT_EQ(end.kind, kStepEnd);
          const auto parts = Dispatcher::step_end_parts(end);
          ASSERT_EQ(parts.size(), static_cast<size_t>(kMbs));
          for (int64_t mb = 0; mb < kMbs; ++mb) {
            EXPECT_EQ(parts[mb].meta, std::string(static_cast<size_t>(mb) + 1, static_cast<char>('a' + mb)));
            ASSERT_EQ(parts[mb].tensors.size(), static_cast<size_t>(mb));
            for (const auto& t : parts[mb].tensors) EXPECT_TRUE(t.equal(at::full({2}, float(mb))));
          }
        }
      }
    }
  });
}

// Note [Step's finish]: the finish runs once per step that ends well, on the driver and
// on the serving rank, told whether a backward ran anywhere (the OR of the parts'
// flags); it never runs for an aborted step, and a step's finish is taken off by running.
TEST(Dispatch, StepFinishRunsOnceWhereTheStepEndsWell) {
  constexpr int64_t kMbs = 3;
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "finish", r, 2, 20);
    Dispatcher d(p2p, schedule(ScheduleKind::kInterleaved, kMbs, 2), answer_of, spawn_thread);
    // Steps: no backward; a backward in microbatch 1 only; an aborted step.
    int64_t epoch = 0;
    for (const int kind : {0, 1, 2}) {
      std::vector<int> ran;  // each call's backward flag
      d.begin_step(kMbs);
      p2p->begin_step(++epoch);
      d.finish_at_step_end([&ran](bool backward) { ran.push_back(backward ? 1 : 0); });
      EXPECT_FALSE(d.finish_began());
      if (r == 0) {
        d.drive_step([&](int64_t mb) {
          if (kind == 2) {
            Message abort = make(mb, 0, kAbort);
            if (mb == 0) abort.meta = "boom";
            return abort;
          }
          return make(mb, (kind == 1 && mb == 1) ? 1 : 0, kStepEnd);
        });
        if (kind == 2) p2p->recv(kAny, kAny, bit(kAbort), "the abort");
      } else {
        d.serve_step();
      }
      if (kind == 2) {
        EXPECT_TRUE(ran.empty()) << "rank " << r;
        EXPECT_FALSE(d.finish_began());
        d.disarm();  // the caller drops the step's finish
      } else {
        ASSERT_EQ(ran.size(), 1u) << "rank " << r << " step " << kind;
        EXPECT_EQ(ran[0], kind) << "rank " << r;
        EXPECT_TRUE(d.finish_began());
      }
    }
      // A finish is taken off by running: a good step runs it, the next step (none set)
    // runs nothing, and finish_began() is false again from that step's begin_step().
    int runs = 0;
    for (const bool set : {true, false}) {
      d.begin_step(kMbs);
      p2p->begin_step(++epoch);
      if (set) d.finish_at_step_end([&runs](bool) { ++runs; });
      if (r == 0)
        d.drive_step([](int64_t mb) { return make(mb, 1, kStepEnd); });
      else
        d.serve_step();
      EXPECT_EQ(runs, 1) << "rank " << r;
      EXPECT_EQ(d.finish_began(), set) << "rank " << r;
    }
  });
}

}  // namespace
}  // namespace smp
