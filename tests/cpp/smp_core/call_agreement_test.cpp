// CallAgreement (Note [Call agreement]): ranks as threads over one real in-memory c10d
// store. Every rank that raises must raise the same text, and quickly.
#include "smp_core/call_agreement.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "smp_core/errors.h"

namespace smp {
namespace {

const char* kRule = "; every rank of a group must make the same smp calls in the same order";

// Runs fn(rank, agreement) on n threads sharing one store; returns each rank's error
// text ("" when it returned).
std::vector<std::string> run_ranks(int n, double timeout_s,
                                   const std::function<void(int, CallAgreement&)>& fn) {
  StorePtr store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      CallAgreement agreement(store, r, timeout_s);
      try {
        fn(r, agreement);
      } catch (const TimeoutError& e) {
        errors[r] = std::string("timeout: ") + e.what();
      } catch (const CommError& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

TEST(CallAgreement, SameCallsInTheSameOrderPass) {
  for (int n = 1; n <= 4; ++n) {
    std::vector<int> all;
    for (int r = 0; r < n; ++r) all.push_back(r);
    auto errors = run_ranks(n, 10, [&](int, CallAgreement& a) {
      for (int i = 0; i < 5; ++i) {  // past the deletion of call #k-2's counter
        a.agree("world", all, "smp.barrier(WORLD)");
        a.agree("world", all, "smp.allgather(WORLD)");
      }
    });
    for (const auto& e : errors) EXPECT_EQ(e, "") << "world " << n;
  }
}

TEST(CallAgreement, DifferentCallsOnOneGroupRaiseOneTextEverywhere) {
  auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks(2, 60, [](int r, CallAgreement& a) {
    a.agree("world", {0, 1}, "smp.barrier(WORLD)");
    a.agree("world", {0, 1}, r == 0 ? "model.state_dict()" : "smp.allgather(WORLD)");
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));  // not 60 s
  EXPECT_EQ(errors[0], std::string("smp: ranks [0] of the world group [0, 1] called "
                                   "model.state_dict() (call #2 on that group), but rank 1 "
                                   "called smp.allgather(WORLD) (its call #2 on the world group "
                                   "[0, 1])") + kRule);
  EXPECT_EQ(errors[1], errors[0]);
}

TEST(CallAgreement, CallsOnTwoGroupsThatWaitForEachOtherRaise) {
  // Rank 0 waits on the pp group for rank 1, which waits on the world group for rank 0.
  auto errors = run_ranks(2, 60, [](int r, CallAgreement& a) {
    if (r == 0)
      a.agree("pp", {0, 1}, "model.state_dict()");
    else
      a.agree("world", {0, 1}, "smp.barrier(WORLD)");
  });
  EXPECT_EQ(errors[0], std::string("smp: ranks [0] of the pp group [0, 1] called "
                                   "model.state_dict() (call #1 on that group), but rank 1 "
                                   "called smp.barrier(WORLD) (its call #1 on the world group "
                                   "[0, 1])") + kRule);
  EXPECT_EQ(errors[1], errors[0]);
}

TEST(CallAgreement, RanksOutsideTheDisagreementRaiseItsText) {
  // pp=2 x dp=2: rank 0 calls model.state_dict() on its pp group {0, 1}; ranks 1-3 call
  // smp.barrier(WORLD). Ranks 2 and 3 cannot see a deadlock themselves (rank 0's call
  // is on a group they are not in); they raise the text ranks 0 and 1 posted.
  auto errors = run_ranks(4, 60, [](int r, CallAgreement& a) {
    if (r == 0)
      a.agree("pp", {0, 1}, "model.state_dict()");
    else
      a.agree("world", {0, 1, 2, 3}, "smp.barrier(WORLD)");
  });
  EXPECT_EQ(errors[0], std::string("smp: ranks [0] of the pp group [0, 1] called "
                                   "model.state_dict() (call #1 on that group), but rank 1 "
                                   "called smp.barrier(WORLD) (its call #1 on the world group "
                                   "[0, 1, 2, 3])") + kRule);
  for (int r = 1; r < 4; ++r) EXPECT_EQ(errors[r], errors[0]) << "rank " << r;
}

TEST(CallAgreement, AMemberThatExitedIsNamed) {
  std::atomic<bool> gone{false};
  auto errors = run_ranks(3, 60, [&](int r, CallAgreement& a) {
    if (r == 2) {
      a.mark_exited("failed (RuntimeError: boom)", 0);
      gone = true;
      return;
    }
    while (!gone) std::this_thread::yield();
    a.agree("world", {0, 1, 2}, "smp.save()");
  });
  const std::string want = std::string("smp: ranks [0, 1] of the world group [0, 1, 2] called "
                                       "smp.save() (call #1 on that group), but rank 2 failed "
                                       "(RuntimeError: boom) without making that call") + kRule;
  EXPECT_EQ(errors[0], want);
  EXPECT_EQ(errors[1], want);
  EXPECT_EQ(errors[2], "");
}

TEST(CallAgreement, ASlowMemberOrOneBusyOnAnotherGroupIsNoError) {
  // Rank 1 first makes a call on a group rank 0 is not in ({1, 2}), with rank 2 late:
  // rank 0 cannot tell that from a deadlock, so it waits, as it must.
  auto errors = run_ranks(3, 60, [](int r, CallAgreement& a) {
    if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    if (r >= 1) a.agree("dp", {1, 2}, "smp.allgather(DP_GROUP)");
    if (r <= 1) a.agree("pp", {0, 1}, "model.state_dict()");
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(CallAgreement, TimeoutNamesTheCallAndTheMissingRank) {
  auto errors = run_ranks(2, 0.3, [](int r, CallAgreement& a) {
    if (r == 0) a.agree("world", {0, 1}, "smp.barrier(WORLD)");
  });
  EXPECT_EQ(errors[0], "timeout: smp: timed out after 0.3 s waiting for ranks [1] of the world "
                       "group [0, 1] to call smp.barrier(WORLD) (call #1 on that group; ranks "
                       "[0] called it); rank 1 has made no smp collective call");
}

}  // namespace
}  // namespace smp
