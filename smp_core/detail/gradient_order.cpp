// The dispatcher's gradient order (Note [Gradient order] in dispatch.h): a gate on each
// parameter's accumulator holds a microbatch's gradient until every earlier
// microbatch's backward work on this rank is over, and the words (kMicrobatchDone) that
// say so; the driver's last hop (Note [Last hop's gradients]). Part of
// Dispatcher::Impl (detail/dispatcher_impl.h).
//
// Threads: gate() runs on the thread of the autograd engine that accumulates a
// gradient, for the task holding the compute token (a driver's task, a serving thread
// running a request or a served backward, autograd's device thread); it may give the
// token up and wait. backward_unit_over() runs on the thread that ran a backward
// request or a W, announce_done() there and on a driver's task as it ends;
// announce_idle() and record_units() on the serving rank's step caller (serve_step());
// order_gradients() and remove_gates() on the owner's thread, before the first step and
// in ~Dispatcher. State: GradientOrder (this file's): `ordering` and `floor` are atomics
// read without `mu` on the gate's fast path, `floor` written only under `mu`
// (mark_done); the accumulators are set before the first step and only read after;
// the rest under `mu`, never held across a send or a receive.
#include <algorithm>
#include <memory>
#include <vector>

#include <torch/csrc/autograd/variable.h>

#include "smp_core/detail/autograd_graph.h"
#include "smp_core/detail/dispatcher_impl.h"
#include "smp_core/errors.h"

namespace smp {

using detail::bit;

void Dispatcher::Impl::GradientOrder::begin_step(int64_t microbatches, bool deterministic) {
  ordering = deterministic && !accumulators.empty();
  floor = 0;
  done.clear();
  serving = false;
  units.assign(static_cast<size_t>(microbatches), 0);
}

// Note [Gradient order]: a microbatch's backward work on this rank is over. The
// word goes out as a kMicrobatchDone, sticky in the mailbox until the step ends:
// the driver sends it to every pp rank when a microbatch's step body returns; a
// serving rank sends it to itself once it has run as many backward requests of the
// microbatch as in the step before (until it knows that, the driver's word does).
void Dispatcher::Impl::announce_done(int64_t mb, bool everyone) noexcept {
  mark_done(mb);  // this rank's own gates need no message for it
  Message m;
  m.mb = mb;
  m.kind = kMicrobatchDone;
  for (int r = 0; r < p2p->size(); ++r) {
    if (!everyone && r != p2p->rank()) continue;
    try {
      p2p->send(r, m);
    } catch (...) {  // a peer gone: the step fails on its own
    }
  }
}

// Microbatch `mb`'s backward work on this rank is over; raises `floor` past every
// microbatch known over. Only here (under `mu`): it only grows.
void Dispatcher::Impl::mark_done(int64_t mb) {
  std::lock_guard<std::mutex> lock(mu);
  grad.done.insert(mb);
  int64_t f = grad.floor.load();
  while (grad.done.count(f)) ++f;
  grad.floor.store(f);
}

void Dispatcher::Impl::backward_unit_over(int64_t mb) {
  if (!grad.ordering) return;
  bool over = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (mb < 0 || mb >= static_cast<int64_t>(grad.units.size())) return;
    ++grad.units[mb];
    over = grad.serving && grad.last_units.size() == grad.units.size() &&
           grad.units[mb] == grad.last_units[mb];
  }
  if (over) announce_done(mb, false);
}

// Called by a parameter's AccumulateGrad (pre hook) with the token held by the task
// whose gradient it is: waits, token given up, until every earlier microbatch's
// backward work on this rank is over.
void Dispatcher::Impl::gate() {
  arm_once();  // Note [Arming at the first backward]: before this accumulation
  if (!grad.ordering) return;
  const int64_t mb = p2p->token_microbatch();
  bool unplanned_wait = false;
  if (p2p->rank() == 0) {
    backward_begins(mb);
    unplanned_wait = last_hop_accumulation(mb);
  }
  int64_t below = grad.floor.load();
  if (mb <= below) return;  // also: no task holds the token (-1)
  if (unplanned_wait)  // Note [Last hop's gradients]
    leave_plan(str_cat("microbatch ", mb, "'s last hop accumulated gradients on the driver, "
                       "which the plan, made from a step whose last hop held none, did not "
                       "order"));
  {
    std::lock_guard<std::mutex> lock(mu);
    stats.ordered_waits++;
  }
  // Taken back at the position it had: the action goes on (Note [Executed plan]).
  const int64_t held = p2p->token_priority();
  const int64_t again = p2p->token_ordered() && held >= 0 ? held
                                                           : priority(mb, Phase::kBackward);
  resign();  // a serving leader: the earlier microbatch's requests must still be served
  while (below < mb) {
    Message m = p2p->recv(below, kAny, bit(kMicrobatchDone) | bit(kAbort) | bit(kStepEnd),
                          str_cat("the end of microbatch ", below, "'s backward work, before "
                                  "microbatch ", mb, "'s gradients accumulate (Note [Gradient "
                                  "order])"),
                          /*yield_token=*/true, again, RecvOrder::kArrival,
                          /*for_holder=*/true);
    if (m.kind != kMicrobatchDone)
      throw CommError(str_cat("smp: the step ended while microbatch ", mb,
                              "'s gradients waited for microbatch ", below, "'s"));
    mark_done(below);
    below = grad.floor.load();
  }
}

// Note [Last hop's gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On the driver a microbatch's backward begins with its last hop: loss.backward()
// in the step body runs the modules after the last remote call, then sends the first
// backward request. Most models' last hop is the loss alone, which accumulates no
// gradient there; a head or a tied embedding on the driver does. The plan needs to
// know (PlanOptions::last_hop_accumulates): under Note [Gradient order] an
// accumulating last hop waits for the previous microbatch's backward on the driver,
// so its fused forward must come after it in the plan; one that accumulates nothing
// need not, and the next loss is not held back behind a whole backward through the
// driver's first stage (it was: the last stage sat idle for it in the drain). The
// driver learns it here, at the first accumulation of a microbatch that has made no
// backward call yet; it is sticky. A planned step whose last hop accumulates where
// its plan said it would not (the first step that shows it) leaves the plan before
// it waits: the action it waits for may come after actions that wait for it.
// Returns whether this accumulation is such a surprise.
bool Dispatcher::Impl::last_hop_accumulation(int64_t mb) {
  std::lock_guard<std::mutex> lock(mu);
  if (mb < 0 || mb >= static_cast<int64_t>(exec.calls.size())) return false;
  for (const auto& c : exec.calls[mb])
    if (c.second) return false;  // a backward call made: past the last hop
  grad.last_hop_grads = true;
  return exec.on && exec.plan && !exec.plan->options().last_hop_accumulates;
}

// After a step that ran backward work: whether it matched the step before (Note
// [Gradient order]); the next step expects this one's.
void Dispatcher::Impl::record_units() {
  std::lock_guard<std::mutex> lock(mu);
  int64_t total = 0;
  for (int64_t u : grad.units) total += u;
  if (total == 0) return;  // an evaluation step says nothing about training steps
  if (!grad.last_units.empty() && grad.last_units != grad.units) stats.unplanned_steps++;
  grad.last_units = grad.units;
}

// Serving: microbatches with no backward work here (in the step before) are over now.
void Dispatcher::Impl::announce_idle() {
  std::vector<int64_t> idle;
  {
    std::lock_guard<std::mutex> lock(mu);
    grad.serving = true;
    if (grad.last_units.size() == grad.units.size())
      for (size_t mb = 0; mb < grad.units.size(); ++mb)
        if (grad.last_units[mb] == 0) idle.push_back(static_cast<int64_t>(mb));
  }
  for (int64_t mb : idle) announce_done(mb, false);
}

// The accumulators outlive the Dispatcher (the parameters hold them): take the gates
// off, they point here.
void Dispatcher::Impl::remove_gates() {
  for (size_t i = 0; i < grad.accumulators.size(); ++i) {
    auto& hooks = grad.accumulators[i]->pre_hooks();
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                               [&](const auto& h) { return h.get() == grad.gate_hooks[i]; }),
                hooks.end());
  }
}

void Dispatcher::order_gradients(const std::vector<at::Tensor>& params) {
  auto& I = *impl_;
  SMP_CHECK(I.grad.accumulators.empty(), "order_gradients: called twice");
  for (const at::Tensor& p : params) {
    if (!p.defined() || !p.requires_grad() || !p.is_leaf()) continue;
    auto acc = torch::autograd::impl::grad_accumulator(p);
    if (!acc) continue;
    auto hook = std::make_unique<detail::GradGateHook>([&I] { I.gate(); });
    I.grad.gate_hooks.push_back(hook.get());
    acc->add_pre_hook(std::move(hook));
    I.grad.accumulators.push_back(std::move(acc));
  }
}

}  // namespace smp
