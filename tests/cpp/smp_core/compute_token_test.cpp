// The pipeline engine's compute token (smp_core/detail/compute_token.cpp: Note [Compute
// token], Note [Planned token order] in p2p.h) over real engines on loopback: grants by
// priority or by planned turn, the order's end, and waits that yield the token. Ranks
// and tasks are threads, no mocks.
#include "smp_core/p2p.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "../common/gloo_world.h"
#include "../common/p2p_helpers.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using namespace testing;

// A task that takes the token at `priority`, sets `got` while it holds it, and gives it back.
std::thread take_token(P2PEngine& eng, int64_t priority, std::atomic<bool>& got) {
  return std::thread([&eng, priority, &got] {
    eng.acquire_token(priority);
    got = true;
    eng.release_token();
  });
}

// Note [Compute token]: waiters get the token in priority order, not arrival order.
TEST(ComputeToken, TokenGoesToLowestPriorityValue) {
  run_gloo_world(1, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 1, 10);
    eng.acquire_token(0);
    std::vector<int> order;
    std::mutex mu;
    std::atomic<int> started{0};
    std::vector<std::thread> ts;
    for (int p : {5, 1, 3}) {
      ts.emplace_back([&, p] {
        started++;
        eng.acquire_token(p);
        {
          std::lock_guard<std::mutex> lock(mu);
          order.push_back(p);
        }
        eng.release_token();
      });
    }
    while (started < 3) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    eng.release_token();
    for (auto& t : ts) t.join();
    EXPECT_EQ(order, (std::vector<int>{1, 3, 5}));
  });
}

// Note [Planned token order]: the token goes to planned positions in list order, even
// when a later one asks first and the earlier one only later; a position already begun
// (smaller than the turn) goes first.
TEST(ComputeToken, PlannedOrderGrantsPositionsInListOrder) {
  run_gloo_world(1, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 1, 10);
    eng.order_token(true);
    std::vector<int> order;
    std::mutex mu;
    std::vector<std::thread> ts;
    for (int p : {2, 1}) {  // both ask before position 0 is taken: neither may go first
      ts.emplace_back([&, p] {
        eng.acquire_token(p);
        {
          std::lock_guard<std::mutex> lock(mu);
          order.push_back(p);
        }
        eng.release_token();
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    {
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_TRUE(order.empty());  // the free token waits for position 0
    }
    eng.acquire_token(0);
    EXPECT_EQ(eng.next_planned(), 1);
    eng.release_token();
    for (auto& t : ts) t.join();
    EXPECT_EQ(order, (std::vector<int>{1, 2}));
    EXPECT_EQ(eng.planned_grants(), (std::vector<int64_t>{0, 1, 2}));
    eng.acquire_token(1);  // an action already begun takes the token back at once
    eng.release_token();
  });
}

// A kPlanOff (or the step's end, an abort) turns the order off: a waiter whose turn
// will not come gets the token; and without one, the wait ends with a named timeout.
TEST(ComputeToken, PlannedOrderEndsOnPlanOffAndTimesOutWhenStuck) {
  run_gloo_world(1, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 1, 1);
    eng.order_token(true);
    std::atomic<bool> got{false};
    std::thread t = take_token(eng, 5, got);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_FALSE(got.load());
    eng.send(0, make(-1, 0, kPlanOff, ""));
    t.join();
    EXPECT_TRUE(got.load());
    EXPECT_FALSE(eng.token_ordered());
    eng.order_token(true);  // the kPlanOff of this step stays: the order stays off
    EXPECT_FALSE(eng.token_ordered());
    eng.begin_step(1);
    eng.order_token(true);
    EXPECT_TRUE(eng.token_ordered());
    try {
      eng.acquire_token(3);
      FAIL() << "a turn that never comes must time out";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("planned action #3"), std::string::npos) << e.what();
    }
  });
}

TEST(ComputeToken, RecvYieldsTheTokenWhileWaiting) {
  run_gloo_world(1, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 1, 10);
    eng.acquire_token(0);
    std::thread other([&] {
      eng.acquire_token(1);  // only possible while the main task waits
      eng.send(0, make(0, 1, kResponse, "wake"));
      eng.release_token();
    });
    Message m = eng.recv(0, 1, bit(kResponse), "wake", /*yield_token=*/true, 0);
    EXPECT_EQ(m.meta, "wake");
    eng.release_token();  // re-acquired by recv
    other.join();
  });
}

// A task whose yielding recv failed does not hold the token; its release on the way
// out must not hand another task's token to a third.
TEST(ComputeToken, FailedYieldingRecvLeavesTheHoldersTokenAlone) {
  run_gloo_world(1, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 1, 1);  // waits time out after 1 s
    std::atomic<bool> b_holds{false}, b_done{false};
    eng.acquire_token(0);
    std::thread b([&] {
      eng.acquire_token(1);  // gets it while A waits
      b_holds = true;
      while (!b_done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      eng.release_token();
    });
    EXPECT_THROW(eng.recv(0, 1, bit(kResponse), "nothing", /*yield_token=*/true, 0), TimeoutError);
    ASSERT_TRUE(b_holds);
    eng.release_token();  // A's guard on its way out: A does not hold the token
    std::atomic<bool> c_got{false};
    std::thread c = take_token(eng, 2, c_got);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_FALSE(c_got);  // B still holds it
    b_done = true;
    b.join();
    c.join();
    EXPECT_TRUE(c_got);
  });
}

// Autograd's device thread running a remote call's backward works for the task that
// holds the token and waits on it: its wait yields that token (another task computes
// meanwhile) and takes it back for the holder, who releases it afterwards.
TEST(ComputeToken, ThreadWorkingForTheHolderYieldsAndReturnsTheToken) {
  run_gloo_world(1, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 1, 10);
    eng.acquire_token(0);  // the task
    std::atomic<bool> other_ran{false};
    std::thread device([&] {  // autograd's device thread, for the task
      Message m = eng.recv(0, 1, bit(kResponse), "the remote backward", /*yield_token=*/true,
                           0, RecvOrder::kArrival, /*for_holder=*/true);
      EXPECT_EQ(m.meta, "grads");
    });
    std::thread other([&] {  // another task: runs only while the token is yielded
      eng.acquire_token(5);
      other_ran = true;
      eng.send(0, make(0, 1, kResponse, "grads"));
      eng.release_token();
    });
    device.join();  // the task waits for its backward
    other.join();
    EXPECT_TRUE(other_ran);
    eng.release_token();  // the task's: it holds the token again
    std::atomic<bool> next{false};
    std::thread after = take_token(eng, 1, next);
    after.join();  // would block for good if the token were stuck with the device thread
    EXPECT_TRUE(next);
  });
}

}  // namespace
}  // namespace smp
