// Join's shadow step: a rank without data this step issues the same collectives as
// its peers' real step, with zeros, so that they complete (docs/join.md); and a failed
// step, the same shadow flagged so that every peer raises (Note [Failed rank], below).
// Part of Reducer::Impl (detail/reducer_impl.h).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "smp_core/detail/reducer_impl.h"

namespace smp {

// After a shadow or abandoned step's bitmap (held under `lock`): if a rank saw a late
// fire, the ranks still training reduce every bucket again (Note [Pipeline overlap]),
// and this rank joins them with what its buckets hold.
void Reducer::Impl::redo_if_late(std::unique_lock<std::mutex>& lock) {
  if (bitmap_slots.late_fires(bitmap.data_ptr<int32_t>()) == 0) return;
  for (size_t b = 0; b < buckets.size(); ++b) launch_locked(b, true);
  auto again = tickets;
  lock.unlock();
  for (size_t b = 0; b < buckets.size(); ++b) await_bucket(b, again[b]);
  lock.lock();
}

void Reducer::Impl::shadow_step(bool failed) {
  std::unique_lock<std::mutex> lock(mu);
  check_usable();
  if (phase != Phase::kIdle)
    throw std::logic_error("smp: Reducer.run_shadow_step() was called inside a step "
                           "(after prepare_for_backward)");
  started = true;
  std::vector<CommQueue::TicketPtr> waits;
  try {
    for (size_t b = 0; b < buckets.size(); ++b) {
      launch_locked(b, true);
      waits.push_back(tickets[b]);
    }
    // Zeros from this rank; the sum comes back, so a late-gradient redo by the ranks
    // still training (Note [Pipeline overlap]) is shadowed too. A failed step sets this
    // rank's failed slot (Note [Used bitmap], Note [Failed rank]).
    bitmap_slots.pack_shadow(bitmap.data_ptr<int32_t>(), rank, failed);
    waits.push_back(
        submit_bitmap_locked("the used-parameter allreduce (shadow step) on " + group));
    if (rebuild_pending) {
      submit_order_locked();
      waits.push_back(order_ticket);
    }
    lock.unlock();
    for (size_t b = 0; b < buckets.size(); ++b) await_bucket(b, waits[b]);
    for (size_t k = buckets.size(); k < waits.size(); ++k) queue->wait(waits[k], opts.timeout_s + 1.0);
    lock.lock();
    if (!failed) check_failed_ranks();
    redo_if_late(lock);
    std::fill(runs.begin(), runs.end(), nullptr);
    if (rebuild_pending) apply_order();
  } catch (const std::exception& e) {
    if (!lock.owns_lock()) lock.lock();
    broken = e.what();
    ++*steps_done;
    rethrow_with_hint(e);
  }
  ++*steps_done;
}

// Note [Failed rank]: a rank that cannot run its step (a bad input, an exception
// before backward) calls fail_step(): a shadow step that sets its failed slot of the
// used bitmap (Note [Used bitmap]). Every other rank reads the slot in finalize() (or
// its own shadow step) and raises CommError naming the failed ranks, instead of
// waiting for the missing rank until the timeout.
void Reducer::Impl::check_failed_ranks() const {
  auto failed = bitmap_slots.failed_ranks(bitmap.data_ptr<int32_t>());
  if (failed.empty()) return;
  std::string who;
  for (int r : failed) who += str_cat(who.empty() ? "" : ",", r);
  throw CommError(str_cat("smp: ", opts.group_name, " rank(s) ", who, " of ", group,
                          " could not run step ", steps_done->load() + 1,
                          " (see the error raised there, e.g. a bad input); every rank "
                          "of the group stops here"));
}

// Note [Failed rank], after arming: the buckets this rank launched carried its real
// gradients; the rest go now with what they hold, and the used bitmap that ends the step
// carries this rank's failed slot, so every peer's finalize() raises naming it. If the
// bitmap went already (every gradient was ready: the failure came after backward), the
// peers' step is whole and completes; this rank only waits for it.
void Reducer::Impl::abandon_step() {
  std::unique_lock<std::mutex> lock(mu);
  if (!broken.empty()) return;  // a failed collective: the peers hear of it themselves
  if (phase == Phase::kIdle) {
    lock.unlock();
    try {
      shadow_step(/*failed=*/true);
    } catch (const std::exception&) {
    }
    return;
  }
  const int64_t step = steps_done->load() + 1;
  try {
    finalizing = true;
    abandoning = true;
    for (size_t i = 0; i < params.size(); ++i)
      if (!ready[i]) mark_ready_locked(static_cast<int64_t>(i));
    launch_ready_locked();
    auto waits = tickets;
    auto bitmap_t = bitmap_ticket, order_t = order_ticket;
    lock.unlock();
    for (size_t b = 0; b < waits.size(); ++b)
      if (waits[b]) queue->wait(waits[b], opts.timeout_s + 1.0);
    if (bitmap_t) queue->wait(bitmap_t, opts.timeout_s + 1.0);
    if (order_t) queue->wait(order_t, opts.timeout_s + 1.0);
    lock.lock();
    redo_if_late(lock);
  } catch (const std::exception&) {
    if (!lock.owns_lock()) lock.lock();
  }
  std::fill(runs.begin(), runs.end(), nullptr);
  abandoning = false;
  broken = str_cat("smp: this rank abandoned step ", step, " of ", group,
                   " after an error (raised there)");
  phase = Phase::kIdle;
  ++*steps_done;
}

void Reducer::run_shadow_step() { impl_->shadow_step(); }
void Reducer::fail_step() { impl_->shadow_step(/*failed=*/true); }
void Reducer::abandon_step() { impl_->abandon_step(); }

}  // namespace smp
