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
// [Pipeline overlap]). The sum makes no copy of a gradient: the allreduce runs in place
// on .grad, and the add to what was set aside runs in place on that.

// Note [Zero gradients stay]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// After zero_grad(set_to_none=False) every .grad is a tensor of zeros. Set aside, it
// stayed beside the gradient the step's backward made anew and, with several
// microbatches, beside torch's copy of the next microbatch's too (Note [One gradient
// copy per weight]): three tensors the tied parameter's size on each holder, where
// torch, adding into .grad, has two (+98 MB on both holders of a tied 32000 x 768
// embedding at pp=4 with 4 microbatches). A gradient whose bits are all zero (+0.0; the
// min and max of an integer view, no temporary) therefore stays in place and the
// backward adds to it. The result has the same bits: numerically +0 + c0 + c1 + ... on
// a holder is c0 + c1 + ..., summed over the holders it is the sum that was added to
// the zeros set aside, and neither has a -0.0 (a sum that starts from +0 never reaches
// -0.0, and +0 + -0 = +0). Any other gradient (-0.0 included; one accumulated over
// steps) is set aside as before, third tensor and all: it must stay out of the sum,
// which would count it once per holder. A gradient left in place joins the sum even
// if the backward added nothing to it (zeros: the same result), and restore() zeroes
// it again, which is exactly what was there.

// Note [One gradient copy per weight]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A rank holding a large weight peaks one copy of it above its parameters and
// gradients, and the copy is torch's: for each microbatch after the first (each one,
// when .grad holds zeros), the backward makes the microbatch's gradient whole
// (nn.Embedding's dense backward: zeros the size of the table, a few rows written; a
// Linear's: the matmul's result), then AccumulateGrad adds it to .grad and frees it.
// The largest weight sets the peak: a tied 32000 x 768 embedding's 98 MB on the two pp
// ranks holding it, ~9 MB on ranks of 768-wide blocks. One process accumulating the
// same microbatches makes the same copy (two for a tied embedding and head, whose
// gradients meet in one backward). It stays: writing a microbatch's gradient into
// .grad directly takes other kernels (addmm with beta 1, index_add_) whose sums round
// differently, and a step gives torch's numbers bit for bit. smp's own parts make
// none: the tied sum (in place), the copies' check (a fingerprint), the copies' start
// (a broadcast in place), deferred init (one tensor at a time, on every rank alike).
// One exception, in the first step: a serving rank does not know yet when a
// microbatch's backward work there is over, so a microbatch's gradient waits whole at
// the gate of Note [Gradient order] (smp_core/dispatch.h) for the driver's word, and up
// to microbatches - 1 of them can wait at once (1 or 2 more copies on the head's rank
// with 4 microbatches). tests/python/test_tied_memory.py counts these copies.
TiedGradients::TiedGradients(std::vector<Entry> held, double timeout_s)
    : held_(std::move(held)), timeout_s_(timeout_s) {
  for (const Entry& e : held_) {
    SMP_CHECK(e.param.defined() && e.param.is_leaf(), "TiedGradients: '", e.name,
              "' is not a leaf tensor");
    SMP_CHECK(e.group, "TiedGradients: '", e.name, "' has no holders' group");
  }
}

namespace {

// Whether every bit of `t` is zero (+0.0 everywhere): min and max of an integer view of
// its elements, one pass and no temporary the tensor's size.
bool all_zero_bits(const at::Tensor& t) {
  if (t.layout() != at::kStrided || t.is_complex()) return false;
  if (t.numel() == 0) return true;
  at::ScalarType bits;
  switch (t.element_size()) {
    case 1: bits = at::kChar; break;
    case 2: bits = at::kShort; break;
    case 4: bits = at::kInt; break;
    case 8: bits = at::kLong; break;
    default: return false;
  }
  auto [lo, hi] = at::aminmax(t.view(bits));
  return lo.eq(0).logical_and_(hi.eq(0)).item<bool>();  // one read back
}

}  // namespace

void TiedGradients::begin_step() {
  before_.assign(held_.size(), at::Tensor());
  in_place_.assign(held_.size(), 0);
  for (size_t i = 0; i < held_.size(); ++i) {
    at::Tensor& grad = held_[i].param.mutable_grad();
    if (grad.defined() && all_zero_bits(grad)) {  // See Note [Zero gradients stay]
      in_place_[i] = 1;
      continue;
    }
    before_[i] = std::exchange(grad, at::Tensor());
  }
  stashed_ = true;
}

void TiedGradients::restore() {
  if (!stashed_) return;
  // Exactly what was set aside: a failed step's contribution here is this holder's
  // alone, never summed, and keeping it would make the copies' gradients differ.
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < held_.size(); ++i) {
    at::Tensor& grad = held_[i].param.mutable_grad();
    if (!in_place_[i]) {
      grad = before_[i];
    } else if (grad.defined()) {
      grad.zero_();  // all zero bits, as it was (Note [Zero gradients stay])
    }
  }
  before_.clear();
  in_place_.clear();
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
    // Left in place, .grad began as zeros and is the sum now (Note [Zero gradients stay]).
    grad = before.defined() ? before.add_(step[0]) : step[0];
  }
  before_.clear();
  in_place_.clear();
  stashed_ = false;
}

}  // namespace smp
