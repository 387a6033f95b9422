// The pipeline engine's compute token (Note [Compute token] and Note [Planned token
// order] in p2p.h): one task at a time computes on a rank; waiters get it by priority,
// or, with the order on, only at their planned turn. Part of P2PEngine::Impl
// (detail/p2p_impl.h).
//
// Threads: any task thread takes and gives back the token (acquire_token(),
// release_token(), and recv() yielding it while it waits, in p2p.cpp); the dispatcher
// turns the order on and off from the driver's step caller and its serving leader; a
// receiver thread turns it off when a message ends the step's order or its peer fails.
// State: the token's members of P2PEngine::Impl, under `mu` (every function here holds
// it, or expects its caller to: *_locked). Each waiter sleeps on a condition variable
// of its own (Note [Targeted wakeups]); a grant installs the task's random stream and a
// release saves it (Note [Microbatch random streams]), both under `mu`.
#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "smp_core/detail/p2p_impl.h"
#include "smp_core/errors.h"
#include "smp_core/task.h"
#include "smp_core/task_rng.h"

namespace smp {

void P2PEngine::Impl::wake_token_locked() {
  if (token_held || token_waiters.empty()) return;
  if (TokenWaiter* w = best_token_waiter()) w->cv.notify_one();
}

void P2PEngine::Impl::unorder_locked() {
  if (!ordered) return;
  ordered = false;
  wake_token_locked();
}

bool P2PEngine::Impl::may_take_locked(TokenWaiter* w) {
  return !token_held && best_token_waiter() == w && (!ordered || w->priority <= next_planned);
}

// Note [Leaving a plan under tp]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under tensor parallelism the tp ranks of a stage must run their distributed blocks'
// collectives in one order (Note [One microbatch at a time under tp] in dispatch.cpp).
// A plan fixes that order; a step that leaves its plan mid-step (an evaluation under
// torch.no_grad() inside a training step, control flow that differs between steps)
// would go on in timing order, and the two tp ranks of a driver could run microbatch
// 1's forward and microbatch 0's backward against each other. So the driver arms this
// for its step when tp > 1, and from the moment it leaves the plan the token goes only
// to tasks of microbatches up to `serial_floor`, the lowest one whose step body has not
// returned: the rest of the step runs one microbatch at a time, in microbatch order,
// the same chain of actions on every tp rank. The serving ranks then see the same
// sequence of requests from their drivers, and under tp they serve it as it came:
// the requests sent before the departure in their lists' order, up to the kPlanOff,
// which the leader takes in its place among them (defer_plan_off: its arrival does
// not turn the order off by itself, which would make the switch a matter of timing),
// and everything after it in arrival order (not by priority among whatever has
// arrived, which also differs with timing). Every departure the driver detects
// happens while one of its tasks holds the token (a call off the path, a backward
// begun early, a step body that returned without its backward), so the point where
// the order changes is the same action on each tp rank; a departure first seen on a
// serving rank (a nested call back) is refused under tp instead (dispatch.cpp). Tasks
// with no microbatch (a serving thread's nested request) are not held back; a
// failure (abort, a lost peer) turns this off, so no wait outlives the step.
bool P2PEngine::Impl::serial_allows_locked(const TokenWaiter* w) const {
  if (!serial_on || !w->task) return true;
  const int64_t mb = w->task->mb.load();
  return mb < 0 || mb <= serial_floor;
}

P2PEngine::Impl::TokenWaiter* P2PEngine::Impl::best_token_waiter() {
  TokenWaiter* best = nullptr;
  for (auto* w : token_waiters) {
    if (!serial_allows_locked(w)) continue;
    if (!best || w->priority < best->priority ||
        (w->priority == best->priority && w->ticket < best->ticket))
      best = w;
  }
  return best;
}

void P2PEngine::Impl::acquire_locked(std::unique_lock<std::mutex>& lock, int64_t priority,
                                     TaskContext* task) {
  TokenWaiter me{priority, next_ticket++, {}, task};
  token_waiters.push_back(&me);
  struct Unregister {
    std::vector<TokenWaiter*>& waiters;
    TokenWaiter* w;
    ~Unregister() { waiters.erase(std::find(waiters.begin(), waiters.end(), w)); }
  } unregister{token_waiters, &me};
  const auto limit = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  while (!may_take_locked(&me)) {
    // Under a plan a turn can be missed for good only if the step went wrong, and
    // then nothing moves: no token hand-over for the timeout ends the wait (a wait
    // by priority always ends: some task holds the token and gives it back).
    if (!ordered && !serial_on) {
      me.cv.wait(lock);
      continue;
    }
    if (!ordered) {
      // Note [Leaving a plan under tp]: the floor moves when a microbatch ends, and
      // every microbatch's wait is bounded, so this one is too.
      const auto since = last_grant;
      if (me.cv.wait_until(lock, since + limit) == std::cv_status::timeout && serial_on &&
          !ordered && !may_take_locked(&me) && last_grant == since)
        throw TimeoutError(str_cat(
            "smp: timed out after ", timeout_s, " s waiting for the compute token for "
            "microbatch ", task ? task->mb.load() : -1, " on pp rank ", rank, ", which after "
            "the step left its plan under tensor parallelism waits for microbatch ",
            serial_floor, " to end (Note [Leaving a plan under tp] in "
            "smp_core/detail/compute_token.cpp)"));
      continue;
    }
    const auto since = last_grant;
    if (me.cv.wait_until(lock, since + limit) == std::cv_status::timeout && ordered &&
        !may_take_locked(&me) && last_grant == since)
      throw TimeoutError(str_cat("smp: timed out after ", timeout_s, " s waiting for the "
                                 "compute token for planned action #", priority, " on pp rank ",
                                 rank, " (the plan's turn is at #", next_planned,
                                 "; Note [Executed plan] in smp_core/detail/plan_execution.cpp)"));
  }
  last_grant = std::chrono::steady_clock::now();
  if (ordered && priority == next_planned) {
    ++next_planned;
    grants.push_back(priority);
  }
  token_priority = priority;
  token_held = true;
  token_owner = std::this_thread::get_id();
  token_since = std::chrono::steady_clock::now();
  token_task = task;
  if (task) task_rng::install(task->rng);
}

bool P2PEngine::Impl::holds_token_locked() const {
  return token_held && token_owner == std::this_thread::get_id();
}

void P2PEngine::Impl::release_locked() {
  if (!holds_token_locked()) return;
  if (token_task && !token_task->rng.empty())
    token_task->rng = task_rng::capture_like(token_task->rng);
  token_task = nullptr;
  token_held = false;
  token_priority = -1;
  stats.token_held_s +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - token_since).count();
  wake_token_locked();
}

void P2PEngine::acquire_token(int64_t priority) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->acquire_locked(lock, priority, current_task());
}

int64_t P2PEngine::token_microbatch() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->token_held && impl_->token_task ? impl_->token_task->mb.load() : -1;
}

void P2PEngine::release_token() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->release_locked();
}

void P2PEngine::order_token(bool on) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& I = *impl_;
  if (!on) return I.unorder_locked();
  for (const Message& m : I.mailbox)  // the step already ended or left its plan
    if (I.ends_order(m) && !(m.kind == kPlanOff && I.plan_off_deferred)) return;
  if (!I.fatal.empty()) return;
  I.ordered = true;
  I.next_planned = 0;
  I.grants.clear();
  I.last_grant = std::chrono::steady_clock::now();
}

void P2PEngine::arm_serial(bool armed) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& I = *impl_;
  I.serial_armed = armed;
  I.serial_on = false;
  I.serial_floor = 0;
  I.wake_token_locked();
}

void P2PEngine::defer_plan_off(bool on) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->plan_off_deferred = on;
}

void P2PEngine::go_serial() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->go_serial_locked();
}

void P2PEngine::Impl::go_serial_locked() {
  if (serial_armed && fatal.empty()) serial_on = true;
}

void P2PEngine::Impl::end_serial_locked() {
  serial_armed = serial_on = false;
  wake_token_locked();
}

void P2PEngine::set_serial_floor(int64_t mb) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  // Monotonic: two microbatches ending together may report their floors out of order.
  impl_->serial_floor = std::max(impl_->serial_floor, mb);
  impl_->wake_token_locked();
}

bool P2PEngine::serial_now() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->serial_on;
}

bool P2PEngine::token_ordered() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->ordered;
}

int64_t P2PEngine::next_planned() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->ordered ? impl_->next_planned : -1;
}

std::vector<int64_t> P2PEngine::planned_grants() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->grants;
}

int64_t P2PEngine::token_priority() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->token_held ? impl_->token_priority : -1;
}

}  // namespace smp
