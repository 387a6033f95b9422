// Making a remote call (smp_core/call.h, Note [Known calls]) against a Server
// (smp_core/serve.h) over real P2P engines on loopback, with C++ hooks in the place of
// Python's: the fast and the general call put the one encoder's bytes on the wire both
// ways, number their calls from one counter, and are nodes of the caller's autograd
// graph whose backward the owner serves from the graph the Server kept.
#include "smp_core/call.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <thread>

#include <torch/torch.h>

#include "../common/gloo_world.h"
#include "smp_core/call_meta.h"
#include "smp_core/dispatch.h"
#include "smp_core/errors.h"
#include "smp_core/serve.h"

namespace smp {
namespace {

using testing::run_gloo_world;

void spawn_thread(std::function<void()> body) { std::thread(std::move(body)).detach(); }

PlanOptions schedule(int64_t microbatches) {
  return step_options(PlanKind::kInterleaved, microbatches, 2, 3);
}

const std::string kFlags("\1\0", 2);

// Pp rank 1's modules: `scale` is y = x * w; `pair` takes (x, z) with a skeleton and
// returns (x * w, z * w) with one. `fails` raises.
struct Owner {
  at::Tensor w = at::full({3}, 3.f).requires_grad_();
  std::mutex mu;
  std::vector<std::string> requests, answers;  // the metas on the wire
  std::vector<bool> flags_passed;

  ServeHooks hooks() {
    ServeHooks h;
    h.run = [this](const ModuleCall& call) {
      {
        std::lock_guard<std::mutex> lock(mu);
        flags_passed.push_back(call.mode_flags != nullptr);
      }
      if (call.module == "fails") throw std::invalid_argument("the owner's module raised");
      ModuleResult r;
      for (const at::Tensor& a : call.args) r.outputs.push_back(a * w);
      if (call.module == "pair") r.skeleton = "OUT";
      return r;
    };
    h.encode_failure = [](std::exception_ptr e, int64_t, bool) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& err) {
        return std::string(err.what());
      }
    };
    return h;
  }
};

struct Result {
  std::map<int64_t, at::Tensor> x_grad, z_grad;
  std::map<int64_t, std::vector<std::string>> skeletons;
  std::string error;
  int64_t fast_calls = 0, served = 0;
  std::vector<std::string> requests, answers;
  std::vector<bool> flags_passed;
  at::Tensor w_grad;
};

Result run_calls(int64_t microbatches, bool with_failure = false) {
  Result res;
  run_gloo_world(2, [&](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    auto p2p = std::make_shared<P2PEngine>(store, "call", r, 2, 20);
    Owner owner;
    auto server = std::make_shared<Server>(owner.hooks(), r);
    auto d = std::make_shared<Dispatcher>(
        p2p, schedule(microbatches),
        [&owner, server](const Message& m) {
          Message answer = server->serve(m);
          std::lock_guard<std::mutex> lock(owner.mu);
          owner.requests.push_back(m.meta);
          owner.answers.push_back(answer.meta);
          return answer;
        },
        spawn_thread);
    server->attach(d);
    Caller caller(d, /*id_base=*/r * 1000);
    d->begin_step(microbatches);
    caller.begin_step();
    if (r == 0) {
      std::mutex mu;
      d->drive([&](int64_t mb) {
        at::Tensor x = at::full({3}, float(mb + 1)).requires_grad_();
        at::Tensor z = at::full({3}, 2.f).requires_grad_();
        try {
          CallOutputs one = caller.call("scale", 1, CallArgs{{x}, ""}, kFlags);
          CallOutputs two = caller.call("pair", 1, CallArgs{{x, z}, "ARGS"}, kFlags);
          if (with_failure) caller.call("fails", 1, CallArgs{{x}, ""}, kFlags);
          // (3x)^2 + 3x * 3z: d/dx = 18x + 9z, d/dz = 9x.
          at::Tensor loss = (one.tensors.at(0) * one.tensors[0]).sum() +
                            (two.tensors.at(0) * two.tensors.at(1)).sum();
          loss.backward();
          std::lock_guard<std::mutex> lock(mu);
          res.x_grad[mb] = x.grad();
          res.z_grad[mb] = z.grad();
          res.skeletons[mb] = {one.skeleton, two.skeleton};
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mu);
          res.error = e.what();
        }
      });
      res.fast_calls = caller.fast_calls();
      p2p->send(1, [] {
        Message end;
        end.mb = -1;
        end.kind = kStepEnd;
        return end;
      }());
    } else {
      EXPECT_EQ(d->serve_step().kind, kStepEnd);
      res.served = server->served();
      res.requests = owner.requests;
      res.answers = owner.answers;
      res.flags_passed = owner.flags_passed;
      if (owner.w.grad().defined()) res.w_grad = owner.w.grad().clone();
    }
  });
  return res;
}

RequestMeta expected_request(const std::string& module, std::vector<bool> requires_grad,
                             std::string skeleton) {
  RequestMeta m;
  m.module = module;
  m.grad = true;
  m.mode_flags = kFlags;
  m.requires_grad = std::move(requires_grad);
  m.skeleton = std::move(skeleton);
  return m;
}

TEST(Call, FastAndGeneralCallsPutTheOneEncodersBytesOnTheWire) {
  Result res = run_calls(2);
  ASSERT_EQ(res.error, "");
  const std::string fast = encode_request(expected_request("scale", {true}, ""));
  const std::string general = encode_request(expected_request("pair", {true, true}, "ARGS"));
  ASSERT_EQ(res.requests.size(), 4u);  // two microbatches, two calls each, in the plan's order
  int fast_seen = 0, general_seen = 0;
  for (size_t i = 0; i < res.requests.size(); ++i) {
    if (res.requests[i] == fast) {
      ++fast_seen;
      EXPECT_EQ(res.answers[i], encode_answer(AnswerMeta{{true}, ""}));
    } else {
      EXPECT_EQ(res.requests[i], general);
      ++general_seen;
      EXPECT_EQ(res.answers[i], encode_answer(AnswerMeta{{true, true}, "OUT"}));
    }
  }
  EXPECT_EQ(fast_seen, 2);
  EXPECT_EQ(general_seen, 2);
  for (int64_t mb = 0; mb < 2; ++mb)
    EXPECT_EQ(res.skeletons[mb], (std::vector<std::string>{"", "OUT"})) << mb;
  EXPECT_EQ(res.fast_calls, 2);
  // Note [Known forward requests]: each metadata's first request of the step applied
  // its flags.
  EXPECT_EQ(res.served, 2);
  EXPECT_EQ(std::count(res.flags_passed.begin(), res.flags_passed.end(), true), 2);
}

TEST(Call, BothCallsAreAutogradNodesServedFromTheKeptGraph) {
  Result res = run_calls(2);
  ASSERT_EQ(res.error, "");
  for (int64_t mb = 0; mb < 2; ++mb) {
    const float x = mb + 1;
    ASSERT_TRUE(res.x_grad[mb].defined() && res.z_grad[mb].defined()) << mb;
    EXPECT_TRUE(res.x_grad[mb].allclose(at::full({3}, 18 * x + 9 * 2.f))) << res.x_grad[mb];
    EXPECT_TRUE(res.z_grad[mb].allclose(at::full({3}, 9 * x))) << res.z_grad[mb];
  }
  // dL/dw = 2 * (3x) * x + 2 * 3 * x * z, over x = 1, 2 and z = 2.
  ASSERT_TRUE(res.w_grad.defined());
  EXPECT_TRUE(res.w_grad.allclose(at::full({3}, 6.f * (1 + 4) + 12.f * (1 + 2)))) << res.w_grad;
}

TEST(Call, AnErrorAnswerIsRaisedOnTheCaller) {
  Result res = run_calls(1, /*with_failure=*/true);
  EXPECT_NE(res.error.find("the owner's module raised"), std::string::npos) << res.error;
}

TEST(Call, OutsideAMicrobatchIsRefusedByName) {
  Caller caller(nullptr, 0);
  try {
    caller.call("head", 1, CallArgs{{at::ones({1})}, ""}, "");
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "smp: module 'head' lives on pp rank 1; call the model "
                                     "inside an @smp.step function");
  }
}

}  // namespace
}  // namespace smp
