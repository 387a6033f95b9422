// The dispatcher's step end and abort, finish and arm (smp_core/detail/step_end.cpp:
// Note [Step end], Note [Step's finish], Note [Arming at the first backward]) over real
// P2P engines on loopback. Ranks are threads, no mocks.
#include "smp_core/dispatch.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "../common/dispatch_helpers.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using namespace testing;

// Note [Step end]: the microbatches' shares reach every pp rank in one kStepEnd, in
// microbatch order whatever order the bodies finished in; a body's error aborts the step
// on every rank instead, the first error only.
TEST(StepEnd, DriveStepSendsOneStepEndOrTheFirstError) {
  constexpr int64_t kMbs = 4;
  run_p2p_world(2, "step_end", 20, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    Dispatcher d(p2p, schedule(PlanKind::kInterleaved, kMbs, 2), answer_of, spawn_thread);
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
TEST(StepEnd, StepFinishRunsOnceWhereTheStepEndsWell) {
  constexpr int64_t kMbs = 3;
  run_p2p_world(2, "finish", 20, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    Dispatcher d(p2p, schedule(PlanKind::kInterleaved, kMbs, 2), answer_of, spawn_thread);
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

// Note [Step end]: a body's abort reaches every waiter of the step: on the serving rank
// the thread waiting in a nested call gets it as its answer and the serving thread that
// took the lead ends the serving with it (serve_step() returns it once every serving
// thread stopped); on the driver, a task waiting for an answer gets it instead.
TEST(StepEnd, AbortReachesEveryServingThreadAndTheDriversTasks) {
  std::mutex mu;  // shared by the two ranks (threads of this process)
  std::condition_variable cv;
  bool nested_waiting = false, served = false;
  run_p2p_world(2, "abort", 20, [&](int r, const std::shared_ptr<P2PEngine>& p2p) {
    std::atomic<int> nested_saw_abort{0}, task_saw_abort{0};
    std::shared_ptr<Dispatcher> d;
    d = std::make_shared<Dispatcher>(
        p2p, schedule(PlanKind::kInterleaved, 2, 2),
        [&](const Message& req) -> Message {  // pp rank 1: a call that waits for a nested one
          {
            std::lock_guard<std::mutex> lock(mu);
            nested_waiting = true;
            cv.notify_all();
          }
          Message m = d->wait(req.mb, 99, kResponse, false, "a nested answer that never comes");
          if (m.kind == kAbort) {
            ++nested_saw_abort;
            EXPECT_EQ(m.meta, "boom");
          }
          Message err = make(0, 0, kError);
          err.meta = "aborted";
          return err;
        },
        spawn_thread);
    d->begin_step(2);
    if (r == 0) {
      const bool ended = d->drive_step([&](int64_t mb) {
        if (mb == 0) {
          p2p->send(1, make(0, 0, kRequest, {at::ones({1})}));
          std::unique_lock<std::mutex> lock(mu);
          EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return nested_waiting; }));
          Message abort = make(0, 0, kAbort);
          abort.meta = "boom";
          return abort;
        }
        // An answer that never comes: the abort (sent to this rank too) ends the wait.
        Message m = d->wait(mb, 7, kResponse, false, "an answer the abort replaces");
        if (m.kind == kAbort) ++task_saw_abort;
        return make(mb, 0, kAbort);  // another failed first: nothing to send
      });
      EXPECT_FALSE(ended);
      EXPECT_EQ(task_saw_abort.load(), 1);
      // The engine stays until pp rank 1's answer to the aborted call went out.
      std::unique_lock<std::mutex> lock(mu);
      EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return served; }));
    } else {
      Message end = d->serve_step();
      EXPECT_EQ(end.kind, kAbort);
      EXPECT_EQ(end.meta, "boom");
      EXPECT_EQ(nested_saw_abort.load(), 1);
      std::lock_guard<std::mutex> lock(mu);
      served = true;
      cv.notify_all();
    }
  });
}

// Note [Arming at the first backward]: arm_now() runs the step's arm once; one that
// throws stays pending and runs again at the next chance; disarm() takes the arm and
// the step's finish off and says whether the arm ran.
TEST(StepEnd, ArmRunsOnceAndDisarmTakesArmAndFinishOff) {
  run_p2p_world(1, "arm", 20, [](int r, const std::shared_ptr<P2PEngine>& p2p) {
    Dispatcher d(p2p, schedule(PlanKind::kInterleaved, 1, 1), answer_of, spawn_thread);
    int arms = 0;
    d.arm_at_first_backward([&] { ++arms; });
    d.arm_now();
    d.arm_now();
    EXPECT_EQ(arms, 1);
    EXPECT_TRUE(d.disarm());
    d.arm_now();
    EXPECT_EQ(arms, 1);
    EXPECT_FALSE(d.disarm());

    bool fail = true;
    d.arm_at_first_backward([&] {
      ++arms;
      if (fail) throw std::runtime_error("arm broke");
    });
    EXPECT_THROW(d.arm_now(), std::runtime_error);
    fail = false;
    d.arm_now();
    EXPECT_EQ(arms, 3);
    EXPECT_TRUE(d.disarm());

    // A disarmed finish does not run at the step's end.
    int finishes = 0;
    d.begin_step(1);
    d.finish_at_step_end([&](bool) { ++finishes; });
    d.disarm();
    EXPECT_TRUE(d.drive_step([](int64_t mb) { return make(mb, 1, kStepEnd); }));
    EXPECT_EQ(finishes, 0);
    EXPECT_FALSE(d.finish_began());
  });
}

// step_end_parts() reads only what the end describes: a header that is missing or
// short, a part beyond the message and bytes left over are protocol errors.
TEST(StepEnd, StepEndPartsRejectsAMalformedEnd) {
  auto words = [](std::vector<int64_t> v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
  };
  auto error_of = [](const Message& end) -> std::string {
    try {
      Dispatcher::step_end_parts(end);
    } catch (const CommError& e) {
      return e.what();
    }
    return "";
  };
  Message end = make(-1, 0, kStepEnd);
  end.meta = "abc";
  EXPECT_NE(error_of(end).find("no header"), std::string::npos) << error_of(end);
  end.meta = words({5, 1, 0});
  EXPECT_NE(error_of(end).find("a short header"), std::string::npos) << error_of(end);
  end.meta = words({1, 4, 1}) + "ab";  // a part of 4 bytes and 1 tensor: 2 bytes, none
  EXPECT_NE(error_of(end).find("a part beyond the message"), std::string::npos) << error_of(end);
  end.meta = words({1, 2, 0}) + "abc";
  EXPECT_NE(error_of(end).find("bytes left over"), std::string::npos) << error_of(end);
  end.meta = words({2, 2, 1, 0, 0}) + "ab";
  end.tensors = {at::ones({1})};
  const auto parts = Dispatcher::step_end_parts(end);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0].meta, "ab");
  EXPECT_EQ(parts[0].tensors.size(), 1u);
  EXPECT_EQ(parts[1].meta, "");
  EXPECT_EQ(parts[1].mb, 1);
}

}  // namespace
}  // namespace smp
