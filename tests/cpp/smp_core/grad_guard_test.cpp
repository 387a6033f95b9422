// Note [Unreduced gradients]: a gradient accumulated outside smp's backward raises
// from inside that backward, through torch's autograd engine, with the parameter's name;
// inside enter()/exit(), or on a serving rank inside a step, it passes.
#include "smp_core/grad_guard.h"

#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/variable.h>

namespace smp {
namespace {

struct Raised : std::runtime_error {
  Raised(const std::string& name, bool in_step)
      : std::runtime_error(name + (in_step ? " in step" : " outside")) {}
};

struct Net {
  at::Tensor w = at::randn({3, 3}).set_requires_grad(true);
  at::Tensor b = at::randn({3}).set_requires_grad(true);
  at::Tensor frozen = at::randn({3});  // requires no gradient: not hooked
  std::vector<std::pair<std::string, at::Tensor>> named() const {
    return {{"w", w}, {"b", b}, {"frozen", frozen}};
  }
  void backward() const {
    auto x = at::randn({2, 3});
    auto loss = (at::matmul(x, w) + b + frozen).sum();
    torch::autograd::backward({loss});
  }
};

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(GradGuard, RaisesOutsideSmpsBackwardWithTheParametersName) {
  Net net;
  std::atomic<int> calls{0};
  GradGuard guard(net.named(), /*serving_rank=*/false, [&](const std::string& name, bool in_step) {
    ++calls;
    throw Raised(name, in_step);
  });
  EXPECT_EQ(guard.size(), 2u);
  // The first accumulator to fire raises: b or w (the engine's order), outside a step.
  auto what = message_of([&] { net.backward(); });
  EXPECT_TRUE(what.find("b outside") != std::string::npos ||
              what.find("w outside") != std::string::npos)
      << what;
  EXPECT_EQ(calls.load(), 1);
  guard.set_in_step(true);  // loss.backward() inside a step: raises too, saying so
  what = message_of([&] { net.backward(); });
  EXPECT_NE(what.find(" in step"), std::string::npos) << what;
}

TEST(GradGuard, PassesInsideEnterExitOnAnyThread) {
  Net net;
  GradGuard guard(net.named(), false, [](const std::string& name, bool in_step) {
    throw Raised(name, in_step);
  });
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {  // microbatches' backwards on task threads, one model
    threads.emplace_back([&] {
      for (int i = 0; i < 20; ++i) {
        guard.enter();
        if (!message_of([&] { net.backward(); }).empty()) ++failures;
        guard.exit();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  guard.enter();
  EXPECT_EQ(message_of([&] { net.backward(); }), "");
  guard.exit();
  EXPECT_FALSE(message_of([&] { net.backward(); }).empty());  // depth back at 0
}

TEST(GradGuard, ServingRankPassesInsideAStepOnly) {
  Net net;
  GradGuard guard(net.named(), /*serving_rank=*/true, [](const std::string& name, bool in_step) {
    throw Raised(name, in_step);
  });
  EXPECT_FALSE(message_of([&] { net.backward(); }).empty());
  guard.set_in_step(true);
  EXPECT_EQ(message_of([&] { net.backward(); }), "");
  guard.set_in_step(false);
  EXPECT_FALSE(message_of([&] { net.backward(); }).empty());
}

TEST(GradGuard, RemoveTakesTheHooksOff) {
  Net net;
  {
    GradGuard guard(net.named(), false, [](const std::string& name, bool in_step) {
      throw Raised(name, in_step);
    });
    guard.remove();
    EXPECT_EQ(guard.size(), 0u);
    EXPECT_EQ(message_of([&] { net.backward(); }), "");
  }
  // A guard destroyed without remove() leaves nothing behind either.
  { GradGuard guard(net.named(), false, [](const std::string& n, bool s) { throw Raised(n, s); }); }
  EXPECT_EQ(message_of([&] { net.backward(); }), "");
}

}  // namespace
}  // namespace smp
