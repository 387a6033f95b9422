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
  best_token_waiter()->cv.notify_one();
}

void P2PEngine::Impl::unorder_locked() {
  if (!ordered) return;
  ordered = false;
  wake_token_locked();
}

bool P2PEngine::Impl::may_take_locked(TokenWaiter* w) {
  return !token_held && best_token_waiter() == w && (!ordered || w->priority <= next_planned);
}

P2PEngine::Impl::TokenWaiter* P2PEngine::Impl::best_token_waiter() {
  TokenWaiter* best = token_waiters.front();
  for (auto* w : token_waiters)
    if (w->priority < best->priority ||
        (w->priority == best->priority && w->ticket < best->ticket))
      best = w;
  return best;
}

void P2PEngine::Impl::acquire_locked(std::unique_lock<std::mutex>& lock, int64_t priority,
                                     TaskContext* task) {
  TokenWaiter me{priority, next_ticket++, {}};
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
    if (!ordered) {
      me.cv.wait(lock);
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
  for (const Message& m : I.mailbox)
    if (I.ends_order(m)) return;  // the step already ended or left its plan
  if (!I.fatal.empty()) return;
  I.ordered = true;
  I.next_planned = 0;
  I.grants.clear();
  I.last_grant = std::chrono::steady_clock::now();
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
