#include "smp_core/tied_grads.h"

#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "smp_core/errors.h"

namespace smp {

// Note [Tied gradient sum]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A parameter held by modules on several pp ranks gets, on each holder, the gradient
// of that holder's uses only. begin_step() sets each .grad aside; after the step's
// backward every holder all-reduces this step's contribution in place on the holders'
// own group (Note [Tied holders' groups] in smp/placement.py: non-holders allocate
// nothing) and adds what it had set aside, which was summed in an earlier step and is
// equal on every holder. So gradient accumulation over steps stays right and the copies
// get bitwise equal gradients. A holder with no contribution this step still joins the
// sum with zeros, unless no holder had one: a one-element presence sum decides, on the
// parameter's device (a NCCL group takes CUDA tensors). The dispatcher calls sum() as
// the step ends (Dispatcher::finish_at_step_end), before the dp reducer's finalize,
// which reads these gradients (they are held out of the buckets until then: Note
// [Pipeline overlap]).
TiedGradients::TiedGradients(std::vector<Entry> held, double timeout_s)
    : held_(std::move(held)), timeout_s_(timeout_s) {
  for (const Entry& e : held_) {
    SMP_CHECK(e.param.defined() && e.param.is_leaf(), "TiedGradients: '", e.name,
              "' is not a leaf tensor");
    SMP_CHECK(e.group, "TiedGradients: '", e.name, "' has no holders' group");
  }
}

void TiedGradients::begin_step() {
  before_.assign(held_.size(), at::Tensor());
  for (size_t i = 0; i < held_.size(); ++i) {
    at::Tensor& grad = held_[i].param.mutable_grad();
    before_[i] = std::exchange(grad, at::Tensor());
  }
  stashed_ = true;
}

void TiedGradients::restore() {
  if (!stashed_) return;
  // Exactly what was set aside: a failed step's contribution here is this holder's
  // alone, never summed, and keeping it would make the copies' gradients differ.
  for (size_t i = 0; i < held_.size(); ++i) held_[i].param.mutable_grad() = before_[i];
  before_.clear();
  stashed_ = false;
}

void TiedGradients::sum() {
  SMP_CHECK(stashed_, "TiedGradients::sum without begin_step");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < held_.size(); ++i) {
    Entry& e = held_[i];
    at::Tensor& grad = e.param.mutable_grad();
    at::Tensor& before = before_[i];
    if (!e.param.requires_grad()) {  // frozen since: nothing to sum
      if (before.defined()) grad = before;
      continue;
    }
    const std::string what = "the sum of tied parameter '" + e.name + "''s gradient over its holders";
    std::vector<at::Tensor> present{at::full({1}, grad.defined() ? 1.0 : 0.0,
                                             at::TensorOptions().dtype(at::kFloat).device(
                                                 e.param.device()))};
    wait_work(e.group->allreduce(present), timeout_s_, what);
    if (present[0].item<float>() == 0.0f) {  // no holder had a gradient this step
      grad = before;
      continue;
    }
    std::vector<at::Tensor> step{grad.defined() ? grad : at::zeros_like(e.param)};
    wait_work(e.group->allreduce(step), timeout_s_, what);  // in place: no copy
    grad = before.defined() ? before.add_(step[0]) : step[0];
  }
  before_.clear();
  stashed_ = false;
}

}  // namespace smp
