// The pipeline engine's transport and mailbox (smp_core/p2p.cpp) over real engines on
// loopback: matching, payloads, layouts, receive order, step epochs, peers that leave.
// The compute token's tests are compute_token_test.cpp.
#include "smp_core/p2p.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "../common/gloo_world.h"
#include "../common/p2p_helpers.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using namespace testing;

TEST(P2P, MatchesByKeyNotArrivalOrder) {
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 2, 10);
    if (r == 0) {
      for (int mb = 0; mb < 4; ++mb)
        eng.send(1, make(mb, 100 + mb, kRequest, "m" + std::to_string(mb),
                         {at::full({3, mb + 1}, mb, at::kFloat), at::arange(mb + 1)}));
      eng.send(1, make(-1, 0, kStepEnd, "end"));
    } else {
      // Receive in reverse order: matching is by (microbatch, call id, kind).
      for (int mb = 3; mb >= 0; --mb) {
        Message m = eng.recv(mb, 100 + mb, bit(kRequest), "request");
        EXPECT_EQ(m.src, 0);
        EXPECT_EQ(m.meta, "m" + std::to_string(mb));
        ASSERT_EQ(m.tensors.size(), 2u);
        EXPECT_TRUE(m.tensors[0].equal(at::full({3, mb + 1}, mb, at::kFloat)));
        EXPECT_TRUE(m.tensors[1].equal(at::arange(mb + 1)));
      }
      // Step-level kinds match whatever microbatch the waiter names.
      EXPECT_EQ(eng.recv(7, kAny, bit(kStepEnd) | bit(kRequest), "end").meta, "end");
    }
  });
}

TEST(P2P, LargeAndEmptyTensorsAndManyDtypes) {
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 2, 10);
    auto big = at::arange(2 * 1024 * 1024, at::kFloat);  // 8 MiB: more than a socket buffer holds (partial writes)
    std::vector<at::Tensor> ts = {big, at::empty({0, 5}), at::ones({3}, at::kHalf),
                                  at::arange(2).gt(0), at::arange(7, at::kLong).view({7, 1})};
    if (r == 0) {
      eng.send(1, make(0, 1, kRequest, std::string(5000, 'x'), ts));
      eng.send(1, make(0, 2, kRequest, "small", {at::ones({2})}));
    } else {
      Message a = eng.recv(0, 1, bit(kRequest), "big");
      ASSERT_EQ(a.tensors.size(), ts.size());
      for (size_t i = 0; i < ts.size(); ++i) {
        EXPECT_EQ(a.tensors[i].scalar_type(), ts[i].scalar_type());
        EXPECT_EQ(a.tensors[i].sizes(), ts[i].sizes());
        EXPECT_TRUE(a.tensors[i].equal(ts[i])) << i;
      }
      EXPECT_EQ(a.meta, std::string(5000, 'x'));
      EXPECT_TRUE(eng.recv(0, 2, bit(kRequest), "small").tensors[0].equal(at::ones({2})));
    }
  });
}

// Note [Payload transports]: tensors by c10d send/recv (Gloo here; NCCL for CUDA), the
// header on the mesh; both directions at once, mixed with tensor-less messages.
TEST(P2P, TensorsByC10dSendRecv) {
  for (auto mode : {PayloadTransport::kC10d, PayloadTransport::kAuto}) {
    run_gloo_world(2, [mode](int r, const compat::ProcessGroupPtr& pg, const compat::StorePtr& store) {
      P2PEngine eng(store, "p2p", r, 2, 10);
      eng.set_payload_group(pg, mode);
      std::vector<at::Tensor> ts = {at::arange(300000, at::kFloat).view({3, 100000}),
                                    at::empty({0, 5}), at::arange(7, at::kLong), at::ones({2}).gt(0)};
      const int peer = 1 - r;
      std::thread sender([&] {
        for (int i = 0; i < 5; ++i) {
          std::vector<at::Tensor> mine;
          for (auto& t : ts) mine.push_back(t + (t.is_floating_point() ? r + i : 0));
          eng.send(peer, make(i, r, kRequest, "t" + std::to_string(i), mine));
          eng.send(peer, make(i, 10 + r, kResponse, "no tensors"));
        }
      });
      for (int i = 4; i >= 0; --i) {  // matched by key, whatever the arrival order
        Message m = eng.recv(i, peer, bit(kRequest), "tensors");
        ASSERT_EQ(m.tensors.size(), ts.size());
        for (size_t k = 0; k < ts.size(); ++k) {
          auto want = ts[k] + (ts[k].is_floating_point() ? peer + i : 0);
          EXPECT_EQ(m.tensors[k].scalar_type(), want.scalar_type());
          EXPECT_TRUE(m.tensors[k].equal(want)) << "mode " << static_cast<int>(mode) << " i " << i;
        }
        EXPECT_EQ(eng.recv(i, 10 + peer, bit(kResponse), "plain").meta, "no tensors");
      }
      sender.join();
    });
  }
}

// Note [Layout travels]: a dense view (transposed, channels-last) arrives with its
// strides, on the mesh and by c10d; any other view arrives contiguous; the random
// stream bytes travel beside the meta, the autocast word in the header (Note [Autocast
// travels]).
TEST(P2P, DenseLayoutsArriveWithTheirStrides) {
  for (auto mode : {PayloadTransport::kTcp, PayloadTransport::kC10d}) {
    run_gloo_world(2, [mode](int r, const compat::ProcessGroupPtr& pg, const compat::StorePtr& store) {
      P2PEngine eng(store, "p2p", r, 2, 10);
      if (mode != PayloadTransport::kTcp) eng.set_payload_group(pg, mode);
      auto base = at::arange(2 * 3 * 4 * 5, at::kFloat).view({2, 3, 4, 5});
      std::vector<at::Tensor> ts = {base.transpose(0, 1), base.contiguous(at::MemoryFormat::ChannelsLast),
                                    base.select(3, 1) /* strided, not dense */,
                                    at::arange(6, at::kFloat).view({2, 3}).t()};
      if (r == 0) {
        Message m = make(0, 1, kRequest, "layouts", ts);
        m.rng = std::string("\x01\x00stream", 8);
        m.autocast = 0x0f01;  // cpu on, bfloat16
        eng.send(1, m);
      } else {
        Message m = eng.recv(0, 1, bit(kRequest), "layouts");
        ASSERT_EQ(m.tensors.size(), ts.size());
        for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(m.tensors[i].equal(ts[i])) << i;
        EXPECT_EQ(m.tensors[0].strides(), ts[0].strides());
        EXPECT_EQ(m.tensors[1].strides(), ts[1].strides());
        EXPECT_EQ(m.tensors[3].strides(), ts[3].strides());
        EXPECT_TRUE(m.tensors[2].is_contiguous());
        EXPECT_EQ(m.rng, std::string("\x01\x00stream", 8));
        EXPECT_EQ(m.autocast, 0x0f01);
        EXPECT_TRUE(m.tensors[0].data_ptr() != ts[0].data_ptr());
      }
    });
  }
}

// Note [Gradient order]: a microbatch's end stays for every waiter of the step, and
// only for its own microbatch.
TEST(P2P, MicrobatchDoneIsStickyPerMicrobatch) {
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 2, r == 0 ? 10 : 0.5);
    if (r == 0) {
      eng.send(1, make(2, 0, kMicrobatchDone, ""));
      eng.recv(0, 1, bit(kResponse), "rank 1's end of the test");
    } else {
      for (int i = 0; i < 3; ++i) EXPECT_EQ(eng.recv(2, kAny, bit(kMicrobatchDone), "mb 2").mb, 2);
      EXPECT_THROW(eng.recv(1, kAny, bit(kMicrobatchDone), "mb 1"), TimeoutError);
      eng.send(0, make(0, 1, kResponse, "done"));
    }
  });
}

TEST(P2P, ConcurrentSendersNeverInterleave) {
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 2, 10);
    const int kThreads = 4, kEach = 25;
    if (r == 0) {
      std::vector<std::thread> ts;
      for (int t = 0; t < kThreads; ++t)
        ts.emplace_back([&, t] {
          for (int i = 0; i < kEach; ++i)
            eng.send(1, make(t, i, kRequest, "", {at::full({100 + i}, t * 1000 + i, at::kInt)}));
        });
      for (auto& t : ts) t.join();
    } else {
      for (int t = 0; t < kThreads; ++t)
        for (int i = kEach - 1; i >= 0; --i) {
          Message m = eng.recv(t, i, bit(kRequest), "message");
          EXPECT_TRUE(m.tensors[0].equal(at::full({100 + i}, t * 1000 + i, at::kInt)));
        }
    }
  });
}

TEST(P2P, TimeoutNamesWhatWasAwaited) {
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 2, 0.3);
    if (r == 1) {
      try {
        eng.recv(3, 9, bit(kResponse), "the response of call 9 (microbatch 3) from pp rank 0");
        ADD_FAILURE() << "no timeout";
      } catch (const TimeoutError& e) {
        EXPECT_STREQ(e.what(), "smp: timed out after 0.3 s waiting for the response of call 9 "
                               "(microbatch 3) from pp rank 0 (pp rank 1)");
      }
      eng.send(0, make(0, 1, kResponse, "done"));
    } else {
      for (int tries = 0;; ++tries) {  // stay until rank 1 has timed out (0.3 s waits)
        try {
          eng.recv(0, 1, bit(kResponse), "rank 1 done");
          break;
        } catch (const TimeoutError&) {
          ASSERT_LT(tries, 30);
        }
      }
    }
  });
}

// A peer that goes away is reported to every waiter at once, naming it: no timeout.
TEST(P2P, PeerThatLeavesIsReportedNotAwaited) {
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto eng = std::make_unique<P2PEngine>(store, "p2p", r, 2, 30);
    if (r == 1) {
      eng->send(0, make(0, 1, kResponse, "last words"));
      eng.reset();
      return;
    }
    EXPECT_EQ(eng->recv(0, 1, bit(kResponse), "last words").meta, "last words");
    auto start = std::chrono::steady_clock::now();
    try {
      eng->recv(0, 2, bit(kResponse), "the response of call 2");
      ADD_FAILURE() << "no error";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("pp rank 1"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("the response of call 2"), std::string::npos);
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  });
}

// Note [Receive order]: among matching messages, the schedule's order picks, not arrival.
TEST(P2P, ReceiveOrderFollowsTheSchedule) {
  run_gloo_world(1, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "order", r, 1, 10);
    const uint32_t serve = bit(kRequest) | bit(kBackwardRequest);
    auto post = [&] {
      eng.send(0, make(2, 1, kRequest, "fwd 2"));
      eng.send(0, make(1, 1, kBackwardRequest, "bwd 1"));
      eng.send(0, make(0, 1, kRequest, "fwd 0"));
      eng.send(0, make(0, 2, kBackwardRequest, "bwd 0"));
    };
    auto drain = [&](RecvOrder order) {
      std::vector<std::string> got;
      for (int i = 0; i < 4; ++i)
        got.push_back(eng.recv(kAny, kAny, serve, "work", false, 0, order).meta);
      return got;
    };
    post();
    EXPECT_EQ(drain(RecvOrder::kBackwardFirst),
              (std::vector<std::string>{"bwd 0", "bwd 1", "fwd 0", "fwd 2"}));
    post();
    EXPECT_EQ(drain(RecvOrder::kForwardFirst),
              (std::vector<std::string>{"fwd 0", "fwd 2", "bwd 0", "bwd 1"}));
    post();
    EXPECT_EQ(drain(RecvOrder::kArrival),
              (std::vector<std::string>{"fwd 2", "bwd 1", "fwd 0", "bwd 0"}));
  });
}

// The step's end, like an abort, is seen by every waiter of the step.
TEST(P2P, StepEndReachesEveryWaiter) {
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "end", r, 2, 10);
    eng.begin_step(1);
    if (r == 0) {
      eng.send(1, make(-1, 0, kStepEnd, "outputs"));
      eng.recv(0, 1, bit(kResponse), "rank 1 done");
      return;
    }
    std::vector<std::thread> waiters;
    std::atomic<int> seen{0};
    for (int mb = 0; mb < 3; ++mb)
      waiters.emplace_back([&, mb] {
        if (eng.recv(mb, kAny, bit(kRequest) | bit(kStepEnd), "work").meta == "outputs") seen++;
      });
    for (auto& t : waiters) t.join();
    EXPECT_EQ(seen.load(), 3);
    eng.send(0, make(0, 1, kResponse, "done"));
  });
}

// The mesh connects every pair of a larger group; messages cross in both directions.
TEST(P2P, FourRanksAllPairs) {
  run_gloo_world(4, [](int r, const compat::ProcessGroupPtr& pg, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p4", r, 4, 10);
    for (int d = 0; d < 4; ++d)
      eng.send(d, make(r, d, kRequest, std::to_string(r) + "->" + std::to_string(d),
                       {at::full({3}, r * 10 + d)}));
    for (int s = 0; s < 4; ++s) {
      Message m = eng.recv(s, r, bit(kRequest), "a hello");
      EXPECT_EQ(m.src, s);
      EXPECT_EQ(m.meta, std::to_string(s) + "->" + std::to_string(r));
      EXPECT_TRUE(m.tensors.at(0).equal(at::full({3}, s * 10 + r)));
    }
    pg->barrier()->wait();  // an engine that leaves early fails its peers' waits
  });
}

}  // namespace
}  // namespace smp

namespace smp {
namespace {

// Note [Step epochs]: a message of the next step waits until the receiver begins that
// step; leftovers of an earlier step are dropped when a new one begins.
TEST(P2P, MessagesMatchOnlyWithinTheirStep) {
  run_gloo_world(2, [](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    P2PEngine eng(store, "p2p", r, 2, 5);
    eng.begin_step(1);
    if (r == 0) {
      eng.send(1, make(0, 1, kRequest, "stale"));   // step 1, never received
      eng.send(1, make(0, 2, kAbort, "abort 1"));   // step 1 abort, sticky
      eng.recv(0, 9, bit(kResponse), "rank 1 moved on");  // sync point (step 1)
      eng.begin_step(2);
      eng.send(1, make(0, 1, kRequest, "fresh"));
    } else {
      EXPECT_EQ(eng.recv(0, kAny, bit(kAbort), "abort").meta, "abort 1");
      eng.send(0, make(0, 9, kResponse, "ok"));
      // Wait for rank 0's step-2 message to arrive while still in step 1.
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      eng.begin_step(2);
      Message m = eng.recv(0, 1, bit(kRequest) | bit(kAbort), "fresh request");
      EXPECT_EQ(m.meta, "fresh");
      EXPECT_EQ(m.epoch, 2);
    }
  });
}

}  // namespace
}  // namespace smp
