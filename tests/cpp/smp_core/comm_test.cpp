#include "smp_core/comm.h"
#include "smp_common/auth.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <thread>

#include <gtest/gtest.h>

#include "../common/gloo_world.h"
#include "smp_core/compat/torch_compat.h"
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
  store_set_sealed(store, "ex/2", "z");
  try {
    store_exchange(store, "ex", 0, 3, "a", 0.2, "the config of every rank");
    FAIL();
  } catch (const TimeoutError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("waiting for the config of every rank from rank(s) 1 (on rank 0)"), std::string::npos) << msg;
  }
  store_set_sealed(store, "ex/1", "y");
  auto all = store_exchange(store, "ex", 0, 3, "a", 1, "x");
  EXPECT_EQ(all, (std::vector<std::string>{"a", "y", "z"}));
}

// compat::compare_set_and_wake (Note [Job secret]): a rank that began waiting for the
// key before rank 0 created it is woken, on a real TCPStore (torch 1.13's server did not
// wake waiters on compareSet: the wait ran out its timeout); a second compareSet keeps
// the first value.
TEST(Comm, CompareSetWakesARankAlreadyWaiting) {
  c10d::TCPStoreOptions opts;
  opts.port = 0;
  opts.isServer = true;
  opts.numWorkers = 2;
  opts.waitWorkers = false;
  opts.timeout = std::chrono::seconds(60);
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  opts.isServer = false;
  opts.port = server->getPort();
  auto client = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  std::exception_ptr waited;
  std::thread waiter([&] {
    try {
      client->wait({"drawn"}, std::chrono::seconds(30));
    } catch (...) {
      waited = std::current_exception();
    }
  });
  // The waiter registers with the server well before the key exists (it holds the
  // waiter otherwise, which the wait above would also pass).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::vector<uint8_t> first{'a'}, second{'b'};
  EXPECT_EQ(compat::compare_set_and_wake(server, "drawn", {}, first), first);
  waiter.join();
  EXPECT_FALSE(waited) << "the waiting rank was not woken";
  EXPECT_EQ(client->get("drawn"), first);
  EXPECT_EQ(compat::compare_set_and_wake(server, "drawn", {}, second), first);
}

// Note [Job secret]: a value written without the job's key (a stranger on the store, or
// a rank with another SMP_JOB_SECRET) is refused, naming whose it was; so is a message.
TEST(Comm, StoreValuesWithoutTheJobKeyAreRefused) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->set("ex/1", std::vector<uint8_t>{'y'});  // no MAC at all
  const std::string other_key = auth::mac(auth::key_from_secret(std::string(64, 'e'), "t"),
                                          "store:ex/2", "z");
  std::vector<uint8_t> forged{'z'};
  forged.insert(forged.end(), other_key.begin(), other_key.end());
  store->set("ex/2", forged);  // sealed under another key
  try {
    store_exchange(store, "ex", 0, 3, "a", 0.1, "the values");
    FAIL();
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("the values from rank(s) 1,2 failed authentication on rank 0"),
              std::string::npos) << e.what();
  }
  StoreMailbox box(store, 1, 0.5, "mb");
  store->set("mb/0/1/0", std::vector<uint8_t>{'p', 'i', 'c', 'k', 'l', 'e'});
  try {
    box.recv(0);
    FAIL();
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("'mb/0/1/0' failed authentication"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace smp
