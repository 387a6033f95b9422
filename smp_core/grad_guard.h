// GradGuard: raises when a parameter's gradient is accumulated outside smp's backward
// under ddp, where it would never be reduced across the model replicas (Note
// [Unreduced gradients] in grad_guard.cpp). A C++ post hook on each parameter's
// gradient accumulator reads two atomics: no Python, and no GIL, on the backward's path.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace smp {

class GradGuard {
 public:
  // Called, on the thread running the backward, with the parameter's name and whether
  // the model was inside a step, when a gradient arrives unguarded. It must throw the
  // error the caller of backward() sees (the Python binding throws the Python
  // exception as torch's python_error, so it keeps its type).
  using Raise = std::function<void(const std::string& name, bool in_step)>;

  // Hooks the gradient accumulator of each (name, parameter) that requires a gradient.
  // `serving_rank`: this rank serves the pipeline's requests (pp size > 1, pp rank > 0):
  // every gradient it accumulates inside a step is the driver's model.backward()
  // reaching it.
  GradGuard(const std::vector<std::pair<std::string, at::Tensor>>& params, bool serving_rank,
            Raise raise);
  ~GradGuard();  // remove()
  GradGuard(const GradGuard&) = delete;
  GradGuard& operator=(const GradGuard&) = delete;

  // Around smp's own backward, on any thread (a microbatch's task among several).
  void enter();
  void exit();
  // Whether the model is inside an @smp.step (the training thread sets it).
  void set_in_step(bool in_step);
  bool in_step() const;
  // Takes the hooks off the accumulators (a later model may wrap the same module).
  void remove();
  // The parameters hooked (those requiring a gradient).
  size_t size() const;

  struct State;  // shared with the hooks (grad_guard.cpp)

 private:
  std::shared_ptr<State> state_;
  struct Hooks;
  std::unique_ptr<Hooks> hooks_;
};

}  // namespace smp
