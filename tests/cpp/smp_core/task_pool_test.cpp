// Note [Task threads]: the pipeline's persistent task threads (smp_core/detail/task_pool.h).
#include "smp_core/detail/task_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

namespace smp::detail {
namespace {

// Waits (bounded) until `done()` holds.
template <typename F>
bool eventually(F done) {
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > limit) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST(TaskPool, OneTaskAtATimeReusesTheIdleThread) {
  std::atomic<int> starts{0}, exits{0};
  std::set<std::thread::id> ran_on;
  std::mutex mu;
  {
    TaskPool pool("t", [&] { ++starts; }, [&] { ++exits; });
    for (int i = 0; i < 5; ++i) {
      std::atomic<bool> done{false};
      pool.spawn([&] {
        std::lock_guard<std::mutex> lock(mu);
        ran_on.insert(std::this_thread::get_id());
        done = true;
      });
      ASSERT_TRUE(eventually([&] { return done.load() && pool.idle() == 1; }));
    }
    EXPECT_EQ(pool.threads(), 1u);
    EXPECT_EQ(ran_on.size(), 1u);
  }  // the destructor stops and joins
  EXPECT_EQ(starts.load(), 1);
  EXPECT_EQ(exits.load(), 1);
}

TEST(TaskPool, ConcurrentTasksGetThreadsOfTheirOwn) {
  TaskPool pool("c");
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  for (int i = 0; i < 3; ++i)
    pool.spawn([&] {  // each waits for all three: only threads of their own get there
      std::unique_lock<std::mutex> lock(mu);
      ++arrived;
      cv.notify_all();
      cv.wait_for(lock, std::chrono::seconds(10), [&] { return arrived == 3; });
    });
  ASSERT_TRUE(eventually([&] { return pool.idle() == 3; }));
  EXPECT_EQ(arrived, 3);
  EXPECT_EQ(pool.threads(), 3u);
}

TEST(TaskPool, StopLetsRunningTasksFinishAndRefusesNewOnes) {
  std::atomic<bool> finished{false};
  TaskPool pool("s");
  pool.spawn([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    finished = true;
  });
  pool.stop();
  EXPECT_TRUE(finished.load());
  EXPECT_EQ(pool.threads(), 0u);
  EXPECT_THROW(pool.spawn([] {}), std::runtime_error);
  pool.stop();  // idempotent
}

TEST(TaskPool, ATaskDropsWhatItHoldsWhenItReturns) {
  TaskPool pool("d");
  auto held = std::make_shared<int>(7);
  std::weak_ptr<int> watch = held;
  pool.spawn([held = std::move(held)] { (void)held; });
  EXPECT_TRUE(eventually([&] { return watch.expired(); }));
}

}  // namespace
}  // namespace smp::detail
