// Join's shadow step: a rank without data this step issues the same collectives as
// its peers' real step, with zeros, so that they complete (docs/join.md); and a failed
// step, the same shadow flagged so that every peer raises (Note [Failed rank]). Part of
// Reducer::Impl (detail/reducer_impl.h).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "smp_core/detail/reducer_impl.h"

namespace smp {

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
    // still training (its last slot, Note [Pipeline overlap]) is shadowed too. A failed
    // step adds kFailedRank + this rank's bit to the last slot (Note [Failed rank]).
    bitmap.zero_();
    if (failed) bitmap.data_ptr<int32_t>()[params.size()] = failed_flag(rank);
    auto what = "the used-parameter allreduce (shadow step) on " + group;
    waits.push_back(queue->submit(what, [g = pg, a = arena, off = bitmap_offset, t = bitmap,
                                         s = opts.timeout_s, what] {
      if (a) {
        a->allreduce(off, t.numel(), at::kInt, /*shadow=*/false, s, what);
      } else {
        std::vector<at::Tensor> v{t};
        wait_work(g->allreduce(v), s, what);
      }
    }));
    if (rebuild_pending) {
      submit_order_locked();
      waits.push_back(order_ticket);
    }
    lock.unlock();
    for (size_t b = 0; b < buckets.size(); ++b) await_bucket(b, waits[b]);
    for (size_t k = buckets.size(); k < waits.size(); ++k) queue->wait(waits[k], opts.timeout_s + 1.0);
    lock.lock();
    if (!failed) check_failed_ranks();
    if (stale_count(bitmap.data_ptr<int32_t>()[params.size()]) > 0) {  // the others redo
      for (size_t b = 0; b < buckets.size(); ++b) launch_locked(b, true);
      auto again = tickets;
      lock.unlock();
      for (size_t b = 0; b < buckets.size(); ++b) await_bucket(b, again[b]);
      lock.lock();
    }
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

void Reducer::run_shadow_step() { impl_->shadow_step(); }
void Reducer::fail_step() { impl_->shadow_step(/*failed=*/true); }

}  // namespace smp
