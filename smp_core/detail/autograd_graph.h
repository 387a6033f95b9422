// Internals of the reducer that touch autograd: the grad-accumulator post hook and
// the walk that finds which parameters a backward from some outputs reaches.
// Included only from smp_core .cpp files.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

namespace smp::detail {

// Calls `fn` after autograd accumulated a parameter's gradient (a post hook on its
// AccumulateGrad node; FACTS.md). Passes the gradients through unchanged.
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

// Calls `fn` before autograd accumulates a parameter's gradient (a pre hook on its
// AccumulateGrad node): Note [Gradient order] in smp_core/dispatch.h. Passes the
// gradients through unchanged; `fn` may block or throw.
class GradGateHook : public torch::autograd::FunctionPreHook {
 public:
  explicit GradGateHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    fn_();
    return grads;
  }

 private:
  std::function<void()> fn_;
};

// Marks reachable[i] = 1 for each parameter i whose AccumulateGrad node (keyed in
// `index`) the autograd graph of `outputs` reaches; `reachable` has one entry per
// parameter. An output that is itself a parameter reaches it.
void mark_reachable(const std::vector<at::Tensor>& outputs,
                    const std::unordered_map<const torch::autograd::Node*, int64_t>& index,
                    std::vector<char>& reachable);

}  // namespace smp::detail
