// The dispatcher's gradient order (smp_core/detail/gradient_order.cpp: Note [Gradient
// order]) over real P2P engines on loopback: the gates on a parameter's accumulator hold
// a microbatch's gradient until every earlier microbatch's backward work on the rank is
// over. Ranks are threads, no mocks.
#include "smp_core/dispatch.h"

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/csrc/autograd/autograd.h>

#include "../common/dispatch_helpers.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using namespace testing;

// Backward requests reach pp rank 1 out of microbatch order: the driver's microbatch 0
// sends its own 300 ms after the others. In a deterministic step the gradients of
// rank 1's parameter still accumulate in microbatch order (microbatches 1 and 2 wait for
// the driver's word that 0, then 1, is over; each wait counted once), and the sum is
// the same; outside one they accumulate as the requests come, 0 last.
TEST(GradientOrder, GradientsAccumulateInMicrobatchOrderAcrossRequestsThatArriveOutOfIt) {
  constexpr int64_t kMbs = 3;
  for (const bool deterministic : {true, false}) {
    run_p2p_world(2, "grad_order", 20, [&](int r, const std::shared_ptr<P2PEngine>& p2p) {
      at::Tensor w = at::ones({2}).set_requires_grad(true);  // this rank's parameter
      std::mutex mu;
      std::map<int64_t, std::pair<at::Tensor, at::Tensor>> graphs;  // mb -> (x, y)
      std::vector<int64_t> accumulated;  // rank 1: microbatches, as their backward ended
      std::shared_ptr<Dispatcher> d;
      d = std::make_shared<Dispatcher>(
          p2p, schedule(PlanKind::kInterleaved, kMbs, 2),
          [&](const Message& req) -> Message {
            if (req.kind == kRequest) {
              at::Tensor x = req.tensors.at(0).clone().set_requires_grad(true);
              at::Tensor y = x * w;
              std::lock_guard<std::mutex> lock(mu);
              graphs[req.mb] = {x, y};
              return make(0, 0, kResponse, {y.detach()});
            }
            std::pair<at::Tensor, at::Tensor> g;
            {
              std::lock_guard<std::mutex> lock(mu);
              g = graphs.at(req.mb);
            }
            torch::autograd::backward({g.second}, {req.tensors.at(0)});  // the gate waits here
            std::lock_guard<std::mutex> lock(mu);
            accumulated.push_back(req.mb);
            return make(0, 0, kBackwardResponse, {g.first.grad()});
          },
          spawn_thread);
      d->order_gradients({w});
      EXPECT_THROW(d->order_gradients({w}), std::exception);
      d->begin_step(kMbs, deterministic);
      if (r == 0) {
        d->drive([&](int64_t mb) {
          const float v = static_cast<float>(mb + 1);
          p2p->send(1, make(mb, mb, kRequest, {at::full({2}, v)}));
          ASSERT_EQ(d->wait(mb, mb, kResponse, false, "the forward answer").kind, kResponse);
          if (mb == 0) {  // later than the others, without the token
            p2p->release_token();
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            p2p->acquire_token(order_priority(d->options().kind, mb, Phase::kBackward));
          }
          p2p->send(1, make(mb, mb, kBackwardRequest, {at::full({2}, 1.f)}));
          Message in = d->wait(mb, mb, kBackwardResponse, true, "the backward answer");
          ASSERT_EQ(in.kind, kBackwardResponse);
          EXPECT_TRUE(in.tensors.at(0).equal(at::ones({2})));
        });
        p2p->send(1, make(-1, 0, kStepEnd));
      } else {
        EXPECT_EQ(d->serve_step().kind, kStepEnd);
        EXPECT_TRUE(w.grad().equal(at::full({2}, 1.f + 2.f + 3.f)));
        ASSERT_EQ(accumulated.size(), static_cast<size_t>(kMbs));
        if (deterministic) {
          EXPECT_EQ(accumulated, (std::vector<int64_t>{0, 1, 2}));
          EXPECT_EQ(d->stats().ordered_waits, 2);
        } else {
          EXPECT_EQ(accumulated.back(), 0);
          EXPECT_EQ(d->stats().ordered_waits, 0);
        }
      }
    });
  }
}

}  // namespace
}  // namespace smp
