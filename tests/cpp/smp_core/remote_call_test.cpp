// A remote call as a node of the caller's autograd graph (smp_core/remote_call.h) over
// real P2P engines on loopback: the owner computes on a graph of its own and the
// caller's backward() gets the input gradients without any Python.
#include "smp_core/remote_call.h"

#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <thread>

#include <torch/csrc/autograd/autograd.h>
#include <torch/torch.h>

#include "../common/dispatch_helpers.h"
#include "../common/gloo_world.h"
#include "smp_core/dispatch.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using testing::run_gloo_world;

Message make(int64_t mb, int64_t call, int32_t kind, std::vector<at::Tensor> tensors = {}) {
  Message m;
  m.mb = mb, m.call_id = call, m.kind = kind;
  m.tensors = std::move(tensors);
  return m;
}

void spawn_thread(std::function<void()> body) { std::thread(std::move(body)).detach(); }

// The owner (pp rank 1) runs y = x * w on a graph it keeps per call, and answers a
// backward request with x's gradient (w's stays on the owner). `fail_backward`: it
// answers the backward with an error instead.
struct Owner {
  at::Tensor w = at::full({3}, 3.f).requires_grad_();
  std::mutex mu;
  std::map<std::pair<int64_t, int64_t>, std::pair<at::Tensor, at::Tensor>> graphs;  // (mb, call) -> (x, y)
  std::vector<std::string> backward_metas;
  bool fail_backward = false;

  Message operator()(const Message& req) {
    std::lock_guard<std::mutex> lock(mu);
    if (req.kind == kRequest) {
      at::Tensor x = req.tensors.at(0).clone().requires_grad_();
      at::Tensor y = x * w;
      graphs[{req.mb, req.call_id}] = {x, y};
      return make(0, 0, kResponse, {y.detach()});
    }
    backward_metas.push_back(req.meta);
    if (fail_backward) {
      Message err = make(0, 0, kError);
      err.meta = "kaboom in the owner's backward";
      return err;
    }
    auto [x, y] = graphs.at({req.mb, req.call_id});
    torch::autograd::backward({y}, {req.tensors.at(0)});
    Message out = make(0, 0, kBackwardResponse, {x.grad()});
    out.meta = gradient_flags({true});
    return out;
  }
};

void run_call(bool fail_backward, std::vector<at::Tensor>* grads, std::string* error,
              std::vector<std::string>* metas, at::Tensor* owner_w_grad) {
  run_gloo_world(2, [&](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "remote_call", r, 2, 20);
    Owner owner;
    owner.fail_backward = fail_backward;
    auto d = std::make_shared<Dispatcher>(p2p, testing::schedule(PlanKind::kInterleaved, 2, 2, 3),
                                          std::ref(owner), spawn_thread);
    d->begin_step(2);
    if (r == 0) {
      std::mutex mu;
      d->drive([&](int64_t mb) {
        at::Tensor anchor = at::zeros({}).requires_grad_();
        at::Tensor x = at::full({3}, float(mb + 1)).requires_grad_();
        Message ans = d->call(1, make(mb, 7, kRequest, {x.detach()}), kResponse, false, "fwd");
        auto outs = connect_remote_call(d, RemoteCallId{1, mb, 7, "owned"}, {anchor, x},
                                        ans.tensors, {true});
        ASSERT_TRUE(outs.at(0).requires_grad());
        at::Tensor loss = (outs[0] * outs[0]).sum();  // (3x)^2: d/dx = 18x
        try {
          loss.backward();
          std::lock_guard<std::mutex> lock(mu);
          (*grads)[mb] = x.grad();
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mu);
          *error = e.what();
        }
      });
      p2p->send(1, make(-1, 0, kStepEnd));
    } else {
      EXPECT_EQ(d->serve_step().kind, kStepEnd);
      *metas = owner.backward_metas;
      if (owner.w.grad().defined()) *owner_w_grad = owner.w.grad().clone();
    }
  });
}

TEST(RemoteCall, BackwardSendsOutputGradientsAndReturnsInputGradients) {
  std::vector<at::Tensor> grads(2);
  std::string error;
  std::vector<std::string> metas;
  at::Tensor w_grad;
  run_call(false, &grads, &error, &metas, &w_grad);
  EXPECT_EQ(error, "");
  for (int64_t mb = 0; mb < 2; ++mb) {
    ASSERT_TRUE(grads[mb].defined()) << mb;
    EXPECT_TRUE(grads[mb].equal(at::full({3}, 18.f * (mb + 1)))) << grads[mb];
  }
  // One flag byte per output; the owner's parameter got both microbatches' gradients:
  // dL/dw = 2 * (3x) * x summed over x = 1 and 2.
  EXPECT_EQ(metas, (std::vector<std::string>{std::string(1, '\1'), std::string(1, '\1')}));
  ASSERT_TRUE(w_grad.defined());
  EXPECT_TRUE(w_grad.allclose(at::full({3}, 6.f * 1 + 6.f * 4)));
}

TEST(RemoteCall, ErrorAnswerIsRaisedOutOfBackward) {
  std::vector<at::Tensor> grads(2);
  std::string error;
  std::vector<std::string> metas;
  at::Tensor w_grad;
  run_call(true, &grads, &error, &metas, &w_grad);
  EXPECT_NE(error.find("kaboom in the owner's backward"), std::string::npos) << error;
}

TEST(RemoteCall, GradientFlagsRejectMalformedMeta) {
  EXPECT_EQ(parse_gradient_flags(gradient_flags({true, false, true}), 3, "x"),
            (std::vector<bool>{true, false, true}));
  EXPECT_THROW(parse_gradient_flags(std::string(2, '\1'), 3, "x"), CommError);
  EXPECT_THROW(parse_gradient_flags(std::string(1, '\2'), 1, "x"), CommError);
}

}  // namespace
}  // namespace smp
