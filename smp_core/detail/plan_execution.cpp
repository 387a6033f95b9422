// The dispatcher's plan execution (Note [Executed plan]): installing the step's plan,
// walking it (each admission's position in the rank's list, checking the driver's
// calls against it), leaving it, and the forward order of a deterministic step
// outside a plan (Note [Forward order]). Part of Dispatcher::Impl
// (detail/dispatcher_impl.h).
//
// Threads: install_plan() and announce_plan() run on the driver's step caller (drive());
// plan_arrived(), next_planned_request() and leave_plan_on_word() on the serving leader;
// admit(), record_call(), start_forward_action(), forward_over(), backward_begins() and
// leave_plan() on a task's thread with the compute token held (a driver's task, a
// serving thread running a request, or autograd's thread working for the holder, in the
// gate); microbatch_over() as a driver's task ends, record_path() and
// leave_plan_quietly() on the driver's step caller after its tasks returned; the
// accessors (planned_actions() ...) on any thread. State: PlanExecution and ForwardOrder
// (this file's), under `mu`; each method takes it for its bookkeeping only and
// calls P2PEngine (order_token, the kPlanOff) after letting it go.
#include <map>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "smp_core/detail/dispatcher_impl.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using detail::kWeightPhase;

// Note [Executed plan]
// The runtime executes the step's plan (smp_core/plan.h) as written, as
// torch.distributed.pipelining runs its pipeline_order: each rank's compute token goes
// to its planned actions in the plan's order (Note [Planned token order] in p2p.h), so
// the action next in the list waits for its turn even when a later one is ready.
//  - The plan comes from the calls recorded in the driver's previous training step:
//    when every microbatch called the same pp ranks in the same order, with a backward
//    call for each forward call in reverse (no call made from another rank's module),
//    the path is 0, d1, 0, d2, ..., 0 and Plan::compile builds every rank's list for
//    the step's kind and window, under the runtime's own constraints (PlanOptions
//    gradient_order and fused_last: a microbatch's backward work on a rank starts
//    after the previous one's is over there, since its gradients would wait for that
//    anyway; Note [Last hop's gradients] for the loss hop). The driver sends the path
//    (kPlan) to every pp rank before its first request, with whether its last hop
//    accumulates; each compiles the same plan.
//  - Admissions: a task takes the token at the start of each compute action: a
//    microbatch's step body (F of hop 0), a served request (F or B), the driver going on
//    after an answer (the next F or B of its microbatch) or, under "simple", starting
//    its backward. Each is the n-th action of (microbatch, phase) on this rank and gets
//    that action's position in the rank's list. On the driver the backward of the last
//    hop follows its forward without a wait (loss.backward() in the step body), so the
//    two are one admission, except under "simple". A task taking the token back in
//    the middle of an action (after Note [Gradient order]'s wait) keeps its position.
//  - Leaving the plan: the driver checks each call of a microbatch against the path,
//    and that the microbatch made them all; any rank checks that each admission is in
//    its list and that nothing else (a nested request) arrives instead of an answer.
//    A step that differs (data-dependent control flow) leaves the plan, by name (Note
//    [Leaving the plan]).
//  - A plan that cannot be compiled or does not validate is an error on every pp rank,
//    with its lists (Note [Plan validation] in smp_core/plan_validate.cpp).
//  - A step that runs no backward (begin_step's `planned` false) runs without a plan
//    and keeps the recorded path for the next training step.

// The admission phase of a compute action (Phase's values, kWeightPhase for W; I is
// what a backward request runs under zero_bubble: Note [Zero bubble at run time]), and
// the action a phase begins where the step has no list (no I there).
int32_t action_phase_of(Op op) {
  return op == Op::kForward          ? static_cast<int32_t>(Phase::kForward)
         : op == Op::kBackwardWeight ? kWeightPhase
                                     : static_cast<int32_t>(Phase::kBackward);
}

Op op_of(int32_t action_phase) {
  return action_phase == static_cast<int32_t>(Phase::kForward) ? Op::kForward
         : action_phase == kWeightPhase                         ? Op::kBackwardWeight
                                                                : Op::kBackward;
}

// The action a failed cell names (B for a backward, whose I the lists may hold).
Op op_of(const FailedCell& failed) {
  return failed.phase == Phase::kForward ? Op::kForward
         : failed.weight                 ? Op::kBackwardWeight
                                         : Op::kBackward;
}

// The driver's calls of a microbatch on `path`: (destination, backward) in order.
std::vector<std::pair<int, bool>> calls_on(const std::vector<int64_t>& path) {
  std::vector<std::pair<int, bool>> calls;
  for (size_t h = 1; h + 1 < path.size(); h += 2) calls.emplace_back(static_cast<int>(path[h]), false);
  for (size_t i = calls.size(); i-- > 0;) calls.emplace_back(calls[i].first, true);
  return calls;
}

// The path a microbatch's calls describe when they are forward calls then the same
// ones' backward calls in reverse; empty otherwise.
std::vector<int64_t> path_of(const std::vector<std::pair<int, bool>>& calls) {
  std::vector<int64_t> path{0};
  for (const auto& [dst, backward] : calls) {
    if (backward) break;
    path.push_back(dst);
    path.push_back(0);
  }
  if (path.size() < 3 || calls_on(path) != calls) return {};
  return path;
}

}  // namespace

void Dispatcher::Impl::PlanExecution::begin_step(int64_t microbatches, bool planned) {
  wanted = planned;
  on = false;
  admitted.clear();
  calls.assign(static_cast<size_t>(microbatches), {});
  nested_seen = false;
  evaluation = false;
  installed = false;
  ran.clear();
}

void Dispatcher::Impl::ForwardOrder::begin_step(int64_t microbatches, bool deterministic) {
  on = deterministic;
  started.assign(static_cast<size_t>(microbatches), 0);
  over.assign(static_cast<size_t>(microbatches), 0);
}

// Makes `path` this step's plan on this rank (Note [Plan validation]: a plan that cannot
// run is an error naming why, with its lists, never a quiet fallback).
void Dispatcher::Impl::install_plan(int64_t microbatches, const std::vector<int64_t>& path,
                                    bool last_hop_accumulates) {
  const PlanOptions& so = opts;
  std::optional<Plan> p;
  {  // the last step's, again (Note [Plan search] may take milliseconds to compile)
    std::lock_guard<std::mutex> lock(mu);
    if (exec.plan && exec.plan->options().path == path &&
        exec.plan->options().microbatches == microbatches &&
        exec.plan->options().last_hop_accumulates == last_hop_accumulates)
      p = exec.plan;
  }
  if (!p) {
    const PlanOptions o = executed_plan_options(so.kind, microbatches, so.stages,
                                                so.active_microbatches, path,
                                                last_hop_accumulates);
    std::string path_text;
    for (int64_t r : path) path_text += str_cat(path_text.empty() ? "" : " ", r);
    try {
      p = Plan::compile(o);
    } catch (const std::exception& e) {
      throw std::logic_error(str_cat("smp: pp rank ", p2p->rank(), " cannot compile the ",
                                     plan_kind_name(o.kind), " plan of ", microbatches,
                                     " microbatches over the path ", path_text,
                                     " that the last training step's calls took: ", e.what()));
    }
    try {
      p->validate();
    } catch (const std::exception& e) {
      throw std::logic_error(str_cat("smp: pp rank ", p2p->rank(), ": the ",
                                     plan_kind_name(o.kind), " plan of ", microbatches,
                                     " microbatches over the path ", path_text,
                                     " does not validate: ", e.what(), "\n", p->format()));
    }
  }
  const int64_t me = p2p->rank();
  const int64_t last = static_cast<int64_t>(path.size()) - 1;
  const bool absorb = me == path[last] && so.kind != PlanKind::kSimple;
  std::vector<Action> mine;
  std::map<std::tuple<int64_t, int32_t, int64_t>, int64_t> pos;
  std::map<std::pair<int64_t, int32_t>, int64_t> count;
  int64_t weight_actions = 0;
  for (const Action& a : p->compute()[me]) {
    if (absorb && a.op == Op::kBackward && a.hop == last) continue;
    const int32_t phase = action_phase_of(a.op);
    weight_actions += a.op == Op::kBackwardWeight;
    pos[{a.mb, phase, count[{a.mb, phase}]++}] = static_cast<int64_t>(mine.size());
    mine.push_back(a);
  }
  std::lock_guard<std::mutex> lock(mu);
  if (!exec.plan || exec.plan->path() != p->path() ||
      exec.plan->options().microbatches != p->options().microbatches)
    stats.new_plans++;
  zb.split_step = p->options().kind == PlanKind::kZeroBubble;
  zb.weights_left = weight_actions;
  exec.plan = std::move(p);
  exec.admissions = std::move(mine);
  exec.position = std::move(pos);
  exec.admitted.clear();
  exec.expected_calls = calls_on(path);
  exec.on = true;
  exec.installed = true;
  stats.planned_steps++;
}

// The path the last training step's calls took, as this step's plan, announced to
// every pp rank before any request: the words are the microbatches, whether the last
// hop accumulates, the path.
void Dispatcher::Impl::announce_plan(int64_t n) {
  std::vector<int64_t> path;
  bool last_hop_grads = true;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (exec.wanted) path = exec.recorded_path;
    last_hop_grads = grad.last_hop_grads;
  }
  if (path.empty()) return;
  try {
    install_plan(n, path, last_hop_grads);
  } catch (const std::exception& e) {
    // Every pp rank raises it (they wait for this step's requests), then the driver.
    Message abort;
    abort.kind = kAbort;
    abort.meta = encode_error ? encode_error(e.what()) : e.what();
    tell_pp_ranks(abort, /*to_self=*/false, /*best_effort=*/true);
    throw;
  }
  {
    std::vector<int64_t> words{n, last_hop_grads ? 1 : 0};
    words.insert(words.end(), path.begin(), path.end());
    Message announce;
    announce.mb = -1;
    announce.kind = kPlan;
    announce.meta = detail::encode_ints(words);
    for (int r = 1; r < p2p->size(); ++r) p2p->send(r, announce);
    p2p->order_token(true);
  }
}

void Dispatcher::Impl::plan_arrived(const Message& msg) {
  const std::vector<int64_t> words = detail::decode_ints(msg.meta);
  if (opts.kind == PlanKind::kZeroBubble) {
    std::lock_guard<std::mutex> lock(mu);
    zb.weights_owed = true;  // the driver waits for this step's kWeightsDone
  }
  // The driver's words: microbatches, whether its last hop accumulates, the path. The
  // driver compiled and validated the same plan before it sent them.
  if (words.size() < 3)
    throw CommError(str_cat("smp: pp rank ", p2p->rank(), " got a plan announcement of ",
                            words.size(), " words from the driver; it needs at least 3"));
  install_plan(words[0], std::vector<int64_t>(words.begin() + 2, words.end()), words[1] != 0);
  p2p->order_token(true);
  bool none_deferred;
  {
    std::lock_guard<std::mutex> lock(mu);
    none_deferred = zb.weights_left == 0;
  }
  if (none_deferred) report_weights();
}

bool Dispatcher::Impl::planned_now() {
  std::lock_guard<std::mutex> lock(mu);
  return exec.on;
}

// Note [Forward order]
// ~~~~~~~~~~~~~~~~~~~~
// A module whose forward changes its own state (BatchNorm's running statistics, a
// counter) gives a result that depends on the order its microbatches reach it. A
// plan fixes that order; the dynamic order would leave it to timing, since a task
// takes the token when its answer arrives. So in a deterministic step the driver,
// outside a plan, starts microbatch k's j-th forward action (a stretch of its step
// body between two remote calls) only once microbatch k-1 has started its j-th, or
// its forward is over (its backward began, or its task ended). The token is held
// by one action at a time, so every module, local or remote, runs its microbatches'
// forwards in microbatch order: a remote one gets their requests over one ordered
// connection, in that order. Microbatch k-1 never waits for k, so this cannot
// deadlock; the cost is a wait when an answer for k arrives before k-1's.
bool Dispatcher::Impl::forward_ordered() {
  return fwd.on && p2p->rank() == 0 && !exec.on;  // (mu held)
}

// Driver, task thread, token held: `mb` starts a forward action (its first at its
// task's start); waits, token given up, until it may (Note [Forward order]).
void Dispatcher::Impl::start_forward_action(int64_t mb, int64_t priority) {
  int64_t j = 0;
  auto may = [&] {  // (mu held)
    return mb == 0 || fwd.over[mb - 1] || fwd.started[mb - 1] > j || serve.over;
  };
  bool wait = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!forward_ordered() || mb < 0 || mb >= static_cast<int64_t>(fwd.started.size())) return;
    j = fwd.started[mb];
    wait = !may();
    if (wait) stats.forward_order_waits++;
  }
  if (wait)
    wait_without_token(may, [priority] { return priority; }, [mb, j] {
      return str_cat("microbatch ", mb - 1, " to start its forward action ", j,
                     " before microbatch ", mb, " (Note [Forward order], pp rank 0)");
    });
  std::lock_guard<std::mutex> lock(mu);
  fwd.started[mb]++;
  cv.notify_all();
}

// Driver: microbatch `mb`'s forward is over (Note [Forward order]).
void Dispatcher::Impl::forward_over(int64_t mb) {
  std::lock_guard<std::mutex> lock(mu);
  if (mb < 0 || mb >= static_cast<int64_t>(fwd.over.size()) || fwd.over[mb]) return;
  fwd.over[mb] = 1;
  cv.notify_all();
}

// The token priority of a task starting its next action of (mb, phase) here.
int64_t Dispatcher::Impl::admit(int64_t mb, Phase phase) {
  return admit(mb, static_cast<int32_t>(phase));
}

int64_t Dispatcher::Impl::admit(int64_t mb, int32_t action_phase) {
  const Phase phase = action_phase == static_cast<int32_t>(Phase::kForward) ? Phase::kForward
                                                                            : Phase::kBackward;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!exec.on) return priority(mb, phase);
    const auto key = std::make_pair(mb, action_phase);
    const int64_t n = exec.admitted[key]++;
    auto it = exec.position.find({mb, key.second, n});
    if (it != exec.position.end()) return it->second;
    why = str_cat("pp rank ", p2p->rank(), " began ",
                  action_phase == kWeightPhase ? "weight-gradient (W)"
                  : phase == Phase::kForward   ? "forward"
                                               : "backward",
                  " action ", n + 1, " of microbatch ", mb, ", which its list does not hold");
  }
  leave_plan(why);
  return priority(mb, phase);
}

void Dispatcher::Impl::took(int64_t mb, int32_t action_phase) {
  std::lock_guard<std::mutex> lock(mu);
  if (exec.on) return;
  exec.ran.push_back(Action{op_of(action_phase), mb, -1, -1});
}

// Note [Leaving the plan]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A step whose calls depart from its plan (control flow that differs between steps: a
// microbatch that calls other pp ranks, or fewer, or calls back into the driver) cannot
// walk the plan's lists any further: the actions it would wait for never come. The rank
// that sees it says so to every pp rank (kPlanOff) and each goes on without a list
// (Note [Order without a list] in smp_core/plan.cpp) for the rest of the step; the
// numbers are the same either way (Note [Microbatch random streams], Note [Gradient
// order]). It is never silent: the rank
// keeps `why` (Dispatcher::plan_departure(); Stats::plan_fallbacks counts it) and the
// Python runtime logs it with the step, and the next training step is planned from
// this step's calls when they are uniform (record_path: re-planned), or runs unplanned
// (Stats::unplanned_steps) when they differ between microbatches.
void Dispatcher::Impl::leave_plan(const std::string& why, bool report) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!exec.on) return;
    exec.on = false;
    if (report) {
      stats.plan_fallbacks++;
      try {
        exec.departure = why;
      } catch (...) {
      }
      exec.departures++;
    }
  }
  p2p->order_token(false);
  p2p->go_serial();  // Note [Leaving a plan under tp] (the driver, when armed)
  Message off;
  off.kind = kPlanOff;
  tell_pp_ranks(std::move(off), /*to_self=*/false, /*best_effort=*/true);
}

// A serving leader: the microbatch and request kind of the action whose turn it is
// (kOwnWeight: a W this rank runs of itself), while this rank executes a plan.
std::optional<std::pair<int64_t, int32_t>> Dispatcher::Impl::next_planned_request() {
  const int64_t next = p2p->next_planned();
  std::lock_guard<std::mutex> lock(mu);
  if (!exec.on || next < 0 || next >= static_cast<int64_t>(exec.admissions.size())) return {};
  const Action& a = exec.admissions[next];
  return std::make_pair(a.mb, a.op == Op::kForward          ? kRequest
                              : a.op == Op::kBackwardWeight ? kOwnWeight
                                                            : kBackwardRequest);
}

// Another rank's kPlanOff: this rank leaves the plan too (counted here as well).
void Dispatcher::Impl::leave_plan_on_word() {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!exec.on) return;
    exec.on = false;
    stats.plan_fallbacks++;
  }
  p2p->order_token(false);
  p2p->go_serial();  // Note [Leaving a plan under tp] (the driver, when armed)
}

// The step is over: the token goes by priority (nothing counted).
void Dispatcher::Impl::leave_plan_quietly() {
  {
    std::lock_guard<std::mutex> lock(mu);
    exec.on = false;
  }
  p2p->order_token(false);
}

// Driver: microbatch `mb` calls `dst` (a forward or backward call).
void Dispatcher::Impl::record_call(int64_t mb, int dst, bool backward) {
  bool off = false;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (mb < 0 || mb >= static_cast<int64_t>(exec.calls.size())) return;
    auto& mine = exec.calls[mb];
    mine.emplace_back(dst, backward);
    const size_t k = mine.size() - 1;
    off = exec.on && (k >= exec.expected_calls.size() || exec.expected_calls[k] != mine.back());
    if (off)
      why = str_cat("microbatch ", mb, "'s call ", k + 1, " went to pp rank ", dst,
                    backward ? " (backward)" : " (forward)", ", where the plan has ",
                    k >= exec.expected_calls.size()
                        ? std::string("no more calls")
                        : str_cat("pp rank ", exec.expected_calls[k].first,
                                  exec.expected_calls[k].second ? " (backward)" : " (forward)"));
  }
  if (off) leave_plan(why);
}

// Driver: microbatch `mb` begins its backward (its gradients are about to
// accumulate, or "simple"'s barrier). A microbatch that made fewer forward calls
// than planned ends its forward here: the ranks waiting for the rest must hear it
// now, before this task waits for anything (Note [Executed plan]).
void Dispatcher::Impl::backward_begins(int64_t mb) {
  forward_over(mb);  // Note [Forward order]
  bool off = false;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!exec.on || mb < 0 || mb >= static_cast<int64_t>(exec.calls.size())) return;
    size_t planned_forward = 0;
    for (const auto& c : exec.expected_calls) planned_forward += !c.second;
    size_t made = 0;
    for (const auto& c : exec.calls[mb]) made += !c.second;
    off = made < planned_forward;
    if (off)
      why = str_cat("microbatch ", mb, " began its backward after ", made,
                    " forward calls to other pp ranks; the plan has ", planned_forward);
  }
  if (off) leave_plan(why);
}

// Note [Evaluation inside a step]
// A step decides whether it trains when it begins (begin_step's `planned`: grad mode on
// at the call), but a script may evaluate with torch.no_grad() inside the step body.
// Its microbatches then make the plan's forward calls and return: the other ranks wait
// for backward actions that never come, so the step leaves the plan as any departure
// does (kPlanOff). That is no departure worth a warning, though, and its calls are no
// training path: the step is not counted or reported, and the recorded path stays the
// last training step's, so training steps between evaluations keep their plan.
namespace {
bool only_planned_forward(const std::vector<std::pair<int, bool>>& calls,
                          const std::vector<std::pair<int, bool>>& expected) {
  std::vector<std::pair<int, bool>> forward;
  for (const auto& c : expected)
    if (!c.second) forward.push_back(c);
  return calls == forward;
}
}  // namespace

// Driver: microbatch `mb`'s step body returned.
void Dispatcher::Impl::microbatch_over(int64_t mb) {
  bool off = false, evaluation = false;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu);
    off = exec.on && mb >= 0 && mb < static_cast<int64_t>(exec.calls.size()) &&
          exec.calls[mb] != exec.expected_calls;
    if (off) {
      evaluation = only_planned_forward(exec.calls[mb], exec.expected_calls);
      exec.evaluation = exec.evaluation || evaluation;
      why = str_cat("microbatch ", mb, "'s step body returned after ", exec.calls[mb].size(),
                    " calls to other pp ranks; the plan has ", exec.expected_calls.size());
    }
  }
  if (off) leave_plan(why, /*report=*/!evaluation);  // Note [Evaluation inside a step]
}

// Driver, after a step: the path its calls describe, for the next training step.
void Dispatcher::Impl::record_path() {
  std::lock_guard<std::mutex> lock(mu);
  // An evaluation step says nothing about training steps (Note [Evaluation inside a step]).
  if (!exec.wanted || exec.evaluation) return;
  std::vector<int64_t> path;
  if (!exec.nested_seen && !exec.calls.empty()) {
    path = path_of(exec.calls[0]);
    for (const auto& c : exec.calls)
      if (c != exec.calls[0]) path.clear();
  }
  exec.recorded_path = std::move(path);
}

std::vector<std::string> Dispatcher::planned_actions() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::string> out;
  for (const Action& a : impl_->exec.admissions) out.push_back(a.str(/*with_hop=*/true));
  return out;
}

// The plan's grants (the token records them, Note [Planned token order] in p2p.h), then
// what ran after the step left it or, without a plan, all it ran (Note [Order without a
// list]).
std::vector<std::string> Dispatcher::executed_actions() const {
  std::vector<int64_t> granted = impl_->p2p->planned_grants();
  std::lock_guard<std::mutex> lock(impl_->mu);
  const auto& exec = impl_->exec;
  std::vector<std::string> out;
  if (exec.installed)
    for (int64_t i : granted)
      if (i >= 0 && i < static_cast<int64_t>(exec.admissions.size()))
        out.push_back(exec.admissions[i].str(/*with_hop=*/true));
  for (const Action& a : exec.ran) out.push_back(a.str());
  return out;
}

std::string Dispatcher::plan_departure() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->exec.departure;
}

std::string Dispatcher::plan_text(const FailedCell* failed) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const auto& exec = impl_->exec;
  if (!exec.installed) return impl_->ran_text(failed);
  const Plan& p = *exec.plan;
  // What ran after the step left its plan, if it did.
  const std::string after = exec.ran.empty() ? "" : impl_->ran_text(nullptr);
  if (!failed || failed->stage < 0 || failed->stage >= static_cast<int64_t>(p.compute().size()))
    return p.format() + after;
  // The failed cell's first action of its phase on its rank.
  const Op op = op_of(*failed);
  for (const Action& a : p.compute().at(failed->stage))
    if (a.mb == failed->mb && (a.op == op || (op == Op::kBackward && a.op == Op::kBackwardInput)))
      return p.format(&a, failed->stage) + after;
  return p.format() + after;
}

// Note [Order without a list]: what this rank ran in a step without a plan (or after it
// left its plan), as one line in the plan's vocabulary, the failed cell marked.
std::string Dispatcher::Impl::ran_text(const FailedCell* failed) const {
  const int64_t me = p2p->rank();
  std::string line = str_cat("pp ", me, " ran |");
  bool marked = false;
  for (const Action& a : exec.ran) {
    std::string cell = a.str();
    if (failed && !marked && failed->stage == me && failed->mb == a.mb &&
        a.op == op_of(*failed)) {
      cell = "[" + cell + "]";
      marked = true;
    }
    line += " " + cell;
  }
  std::string out = str_cat("order without a list (", plan_kind_name(opts.kind),
                            exec.installed ? ", after the step left its plan" : "",
                            "), this rank's actions as they ran:\n", line, "\n");
  if (failed)
    out += str_cat("failed: pp rank ", failed->stage, ", microbatch ", failed->mb, ", ",
                   failed->phase == Phase::kForward ? "forward"
                   : failed->weight                 ? "backward (W)"
                                                    : "backward",
                   marked ? "" : failed->stage == me ? " (not begun here)" : " (on another rank)",
                   "\n");
  return out;
}

}  // namespace smp
