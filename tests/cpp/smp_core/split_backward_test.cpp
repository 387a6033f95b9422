// Note [Split backward]: a backward run as its input half, then its weight half, gives
// what one full backward gives; the input half leaves every parameter alone.
#include "smp_core/detail/split_backward.h"

#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/variable.h>

#include "smp_core/detail/autograd_graph.h"

namespace smp::detail {
namespace {

// A model as a function of its leaves: returns its outputs. Leaves [0, inputs) are the
// call's inputs, the rest its parameters.
using Model = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

std::vector<at::Tensor> leaves_like(const std::vector<at::Tensor>& values) {
  std::vector<at::Tensor> out;
  for (const auto& v : values) out.push_back(v.clone().set_requires_grad(true));
  return out;
}

struct Grads {
  std::vector<at::Tensor> inputs, params;
};

// The full backward: every leaf's .grad.
Grads full(const Model& model, const std::vector<at::Tensor>& values, size_t n_inputs,
           const std::vector<at::Tensor>& out_grads) {
  auto leaves = leaves_like(values);
  auto outs = model(leaves);
  torch::autograd::backward(outs, out_grads);
  Grads g;
  for (size_t i = 0; i < leaves.size(); ++i)
    (i < n_inputs ? g.inputs : g.params).push_back(leaves[i].grad());
  return g;
}

// I, then W. Checks on the way that I leaves the parameters' .grad untouched.
Grads split(const Model& model, const std::vector<at::Tensor>& values, size_t n_inputs,
            const std::vector<at::Tensor>& out_grads, bool* weight_empty = nullptr) {
  auto leaves = leaves_like(values);
  auto outs = model(leaves);
  const std::vector<at::Tensor> inputs(leaves.begin(), leaves.begin() + n_inputs);
  WeightHalf w;
  Grads g;
  g.inputs = backward_input_half(outs, out_grads, inputs, &w);
  for (size_t i = n_inputs; i < leaves.size(); ++i)
    EXPECT_FALSE(leaves[i].grad().defined()) << "parameter " << i - n_inputs << " after I";
  for (size_t i = 0; i < n_inputs; ++i)
    EXPECT_FALSE(leaves[i].grad().defined()) << "I accumulated into input " << i;
  if (weight_empty) *weight_empty = w.empty();
  w.run();
  for (size_t i = n_inputs; i < leaves.size(); ++i) g.params.push_back(leaves[i].grad());
  return g;
}

void expect_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                 const char* what, bool exact) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << " " << i;
    if (!a[i].defined()) continue;
    if (exact) EXPECT_TRUE(at::equal(a[i], b[i])) << what << " " << i;
    else EXPECT_TRUE(at::allclose(a[i], b[i], 1e-6, 1e-6)) << what << " " << i;
  }
}

void check(const Model& model, const std::vector<at::Tensor>& values, size_t n_inputs,
           bool exact = true) {
  auto probe = model(leaves_like(values));
  std::vector<at::Tensor> out_grads;
  for (const auto& o : probe) out_grads.push_back(at::randn_like(o));
  const Grads want = full(model, values, n_inputs, out_grads);
  const Grads got = split(model, values, n_inputs, out_grads);
  expect_same(got.inputs, want.inputs, "input gradient", exact);
  expect_same(got.params, want.params, "parameter gradient", exact);
}

TEST(SplitBackward, MlpEqualsTheFullBackwardBitForBit) {
  at::manual_seed(1);
  // x (input); w1, b1, w2, b2 (parameters): linear -> gelu -> linear.
  check([](const auto& l) {
          return std::vector<at::Tensor>{at::linear(at::gelu(at::linear(l[0], l[1], l[2])), l[3], l[4])};
        },
        {at::randn({5, 4}), at::randn({8, 4}), at::randn({8}), at::randn({3, 8}), at::randn({3})},
        1);
}

TEST(SplitBackward, OutputsOffTheInputPathAndUnusedInputs) {
  at::manual_seed(2);
  // x, z (inputs; z unused); w, b, c (parameters). The second output never reaches x.
  check([](const auto& l) {
          return std::vector<at::Tensor>{at::linear(l[0], l[2], l[3]).tanh(), l[4] * 3 + l[3].sum()};
        },
        {at::randn({2, 4}), at::randn({2, 4}), at::randn({6, 4}), at::randn({6}), at::randn({6})},
        2);
}

TEST(SplitBackward, AWeightUsedTwiceAcrossTheInputPathIsCountedOnce) {
  at::manual_seed(3);
  // x (input); w (parameter) used before and after a tanh on the input path: both uses
  // are boundaries of one group, the lower one reached again from the upper one.
  check([](const auto& l) {
          return std::vector<at::Tensor>{at::matmul(at::matmul(l[0], l[1]).tanh(), l[1])};
        },
        {at::randn({3, 4}), at::randn({4, 4})}, 1, /*exact=*/false);
}

TEST(SplitBackward, InputOnlyGraphHasNoWeightHalf) {
  at::manual_seed(4);
  bool empty = false;
  auto values = std::vector<at::Tensor>{at::randn({3})};
  Model model = [](const auto& l) { return std::vector<at::Tensor>{l[0].sin() * 2}; };
  const Grads got = split(model, values, 1, {at::ones({3})}, &empty);
  EXPECT_TRUE(empty);
  EXPECT_TRUE(at::allclose(got.inputs[0], values[0].cos() * 2));
}

// The parameters' AccumulateGrad pre hooks (Note [Gradient order]'s gate, the reducer's
// arm) run in W, not in I.
TEST(SplitBackward, AccumulatorHooksRunInTheWeightHalf) {
  at::manual_seed(5);
  auto x = at::randn({2, 3}).set_requires_grad(true);
  auto w = at::randn({4, 3}).set_requires_grad(true);
  int gates = 0;
  auto acc = torch::autograd::impl::grad_accumulator(w);
  acc->add_pre_hook(std::make_unique<GradGateHook>([&] { ++gates; }));
  auto y = at::linear(x, w).relu();
  WeightHalf half;
  auto gx = backward_input_half({y}, {at::ones_like(y)}, {x}, &half);
  EXPECT_TRUE(gx[0].defined());
  EXPECT_EQ(gates, 0);
  EXPECT_FALSE(half.empty());
  half.run();
  EXPECT_EQ(gates, 1);
  EXPECT_TRUE(w.grad().defined());
}

// W reaches the parameters in the order a whole backward does, the last layer's first:
// DDP's buckets (last layers first) then launch while the rest of W runs.
TEST(SplitBackward, WeightHalfAccumulatesTheLastLayerFirst) {
  at::manual_seed(6);
  auto x = at::randn({2, 4}).set_requires_grad(true);
  auto w1 = at::randn({4, 4}).set_requires_grad(true);
  auto w2 = at::randn({4, 4}).set_requires_grad(true);
  auto w3 = at::randn({4, 4}).set_requires_grad(true);
  std::vector<int> order;
  std::vector<decltype(torch::autograd::impl::grad_accumulator(w1))> keep;
  for (auto [w, id] : {std::pair{w1, 1}, std::pair{w2, 2}, std::pair{w3, 3}}) {
    keep.push_back(torch::autograd::impl::grad_accumulator(w));
    keep.back()->add_pre_hook(std::make_unique<GradGateHook>([&order, id = id] { order.push_back(id); }));
  }
  auto y = at::linear(at::linear(at::linear(x, w1).tanh(), w2).tanh(), w3);
  WeightHalf half;
  backward_input_half({y}, {at::ones_like(y)}, {x}, &half);
  half.run();
  EXPECT_EQ(order, (std::vector<int>{3, 2, 1}));
}

}  // namespace
}  // namespace smp::detail
