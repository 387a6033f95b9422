#include "smp_core/grad_guard.h"

#include <mutex>

#include <torch/csrc/autograd/variable.h>

#include "smp_core/compat/torch_compat.h"
#include "smp_core/detail/autograd_graph.h"
#include "smp_core/errors.h"

namespace smp {

// Note [Unreduced gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With ddp and more than one replica, a gradient that reaches a parameter outside
// smp's backward is never reduced across the replicas, which then drift apart
// silently. So each parameter's gradient accumulator (torch's AccumulateGrad node, the
// node DDP hooks too: `torch.autograd.grad` and gradients of non-leaf tensors do not
// fire it) gets a post hook, and a gradient is expected only while smp runs a backward:
// - inside `model.backward()` (any microbatch's, on any thread): enter()/exit();
// - on a pipeline rank that serves requests (pp rank > 0) while the model is inside a
//   step: its backward work is the driver's `model.backward()` reaching it, served in
//   C++ (Note [Served backward] in dispatch.h).
// Anything else is `loss.backward()` (inside or outside `@smp.step`) or
// `torch.autograd.backward` on the model's outputs, and raises from inside that
// backward, before the optimizer can apply the gradient. Every rank of a ddp job runs
// the same code, so every rank raises. The hook reads two atomics per parameter per
// backward; only the error path calls `raise` (which, from Python, takes the GIL). The
// guard's hook is registered before the reducer's (the model hooks at its
// construction), so an unguarded gradient never reaches a bucket.
struct GradGuard::State {
  std::atomic<int64_t> depth{0};
  std::atomic<bool> in_step{false};
  bool serving_rank = false;
  Raise raise;

  void check(const std::string& name) const {
    if (depth.load(std::memory_order_acquire) > 0) return;
    const bool stepping = in_step.load(std::memory_order_acquire);
    if (stepping && serving_rank) return;
    raise(name, stepping);
    SMP_CHECK(false, "GradGuard: the gradient of parameter '", name,
              "' was computed outside smp's backward under ddp");  // `raise` did not throw
  }
};

struct GradGuard::Hooks {
  std::mutex mu;
  std::vector<compat::GradAccumulatorPtr> accumulators;  // kept alive, as in the reducer
  std::vector<uintptr_t> keys;
};

GradGuard::GradGuard(const std::vector<std::pair<std::string, at::Tensor>>& params,
                     bool serving_rank, Raise raise)
    : state_(std::make_shared<State>()), hooks_(std::make_unique<Hooks>()) {
  SMP_CHECK(raise, "GradGuard: no raise function");
  state_->serving_rank = serving_rank;
  state_->raise = std::move(raise);
  std::weak_ptr<State> weak = state_;
  for (const auto& [name, p] : params) {
    if (!p.defined() || !p.requires_grad() || !p.is_leaf()) continue;
    auto acc = torch::autograd::impl::grad_accumulator(p);
    SMP_CHECK(acc, "GradGuard: parameter '", name, "' has no gradient accumulator");
    hooks_->keys.push_back(acc->add_post_hook(std::make_unique<detail::GradReadyHook>(
        [weak, name = name] {
          if (auto state = weak.lock()) state->check(name);
        })));
    hooks_->accumulators.push_back(std::move(acc));
  }
}

GradGuard::~GradGuard() { remove(); }

void GradGuard::enter() { state_->depth.fetch_add(1, std::memory_order_acq_rel); }

void GradGuard::exit() { state_->depth.fetch_sub(1, std::memory_order_acq_rel); }

void GradGuard::set_in_step(bool in_step) {
  state_->in_step.store(in_step, std::memory_order_release);
}

bool GradGuard::in_step() const { return state_->in_step.load(std::memory_order_acquire); }

void GradGuard::remove() {
  std::lock_guard<std::mutex> lock(hooks_->mu);
  for (size_t i = 0; i < hooks_->accumulators.size(); ++i)
    hooks_->accumulators[i]->del_post_hook(hooks_->keys[i]);
  hooks_->accumulators.clear();
  hooks_->keys.clear();
}

size_t GradGuard::size() const {
  std::lock_guard<std::mutex> lock(hooks_->mu);
  return hooks_->keys.size();
}

}  // namespace smp
