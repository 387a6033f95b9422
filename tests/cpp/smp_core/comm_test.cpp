#include "smp_core/comm.h"

#include <gtest/gtest.h>

#include "../common/gloo_world.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using testing::run_gloo_world;

// Rank r contributes a string of r*7 bytes of value 'a'+r: sizes 0, odd, uneven.
std::string payload(int r) { return std::string(static_cast<size_t>(r) * 7, static_cast<char>('a' + r)); }

TEST(Comm, AllgatherBytesInRankOrder) {
  for (int n = 1; n <= 4; ++n) {
    run_gloo_world(n, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
      auto all = allgather_bytes(pg, payload(r), 10, "test allgather");
      ASSERT_EQ(static_cast<int>(all.size()), n);
      for (int i = 0; i < n; ++i) EXPECT_EQ(all[i], payload(i));
    });
  }
}

TEST(Comm, BroadcastBytesFromEveryRoot) {
  run_gloo_world(3, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    for (int root = 0; root < 3; ++root) {
      std::string got = broadcast_bytes(pg, r == root ? payload(root + 1) : "", root, 10, "bcast");
      EXPECT_EQ(got, payload(root + 1));
    }
    barrier(pg, 10, "test barrier");
  });
}

TEST(Comm, MailboxRingSendsBeforeReceiving) {
  const int n = 4;
  run_gloo_world(n, [&](int r, const ProcessGroupPtr&, const StorePtr& store) {
    StoreMailbox box(store, r, 10);
    // Every rank sends twice to its right neighbour before receiving: buffered, ordered.
    box.send((r + 1) % n, "first from " + std::to_string(r));
    box.send((r + 1) % n, "second from " + std::to_string(r));
    int left = (r + n - 1) % n;
    EXPECT_EQ(box.recv(left), "first from " + std::to_string(left));
    EXPECT_EQ(box.recv(left), "second from " + std::to_string(left));
  });
}

TEST(Comm, MailboxTimeoutNamesSender) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr&, const StorePtr& store) {
    StoreMailbox box(store, r, 0.2);
    if (r == 0) {
      try {
        box.recv(1);
        ADD_FAILURE() << "recv returned without a message";
      } catch (const TimeoutError& e) {
        EXPECT_NE(std::string(e.what()).find("waiting for message #0 from rank 1 on rank 0"),
                  std::string::npos) << e.what();
      }
    }
  });
}

TEST(Comm, StoreExchangeNamesMissingRanks) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  // Ranks 0 and 2 of 3 post; rank 1 never does.
  store->set("ex/2", std::vector<uint8_t>{'z'});
  try {
    store_exchange(store, "ex", 0, 3, "a", 0.2, "the config of every rank");
    FAIL();
  } catch (const TimeoutError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("waiting for the config of every rank from rank(s) 1 (on rank 0)"), std::string::npos) << msg;
  }
  store->set("ex/1", std::vector<uint8_t>{'y'});
  auto all = store_exchange(store, "ex", 0, 3, "a", 1, "x");
  EXPECT_EQ(all, (std::vector<std::string>{"a", "y", "z"}));
}

}  // namespace
}  // namespace smp
