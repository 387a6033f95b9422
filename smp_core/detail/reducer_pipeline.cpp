// Pipeline overlap: the reducer's part of a synchronized step with partitions > 1
// (Note [Pipeline overlap]). Part of Reducer::Impl (detail/reducer_impl.h).
#include <ATen/ATen.h>

#include <algorithm>

#include "smp_core/detail/reducer_impl.h"

namespace smp {

// Note [Pipeline overlap]: with partitions > 1 a rank runs the backward of each
// microbatch's calls separately, so a parameter's accumulator fires once per call of
// its module per microbatch, and its gradient is final after the last of them. The
// reducer counts the fires of each synchronized pipeline step and, from the next one
// on, takes a parameter as ready when its count reaches the last step's: its bucket
// then launches while the rest of the pipeline's backward runs. The tail (the
// used bitmap) waits for finalize(); its late-fires slot (Note [Used bitmap]) carries
// the number of fires that came after their parameter was copied out (a module called
// more often than in the step before). If any rank saw one, every rank discards the step's
// results and reduces every gradient again from .grad, which still holds the local
// sums (results are written back only after that check). Held parameters (tied
// weights, summed across pp ranks after the step) are ready only in finalize(), as
// is everything with gradient_as_bucket_view (the bucket would alias .grad).
void Reducer::Impl::prepare_pipeline(double grad_scale, const std::vector<int64_t>& held) {
  prepare(true, grad_scale, {}, &held);
}

void Reducer::Impl::arm_pipeline_locked(const std::vector<int64_t>& held) {
  stale = 0;
  fires.assign(params.size(), 0);
  hold.assign(params.size(), opts.gradient_as_bucket_view ? 1 : 0);
  for (int64_t i : held) {
    SMP_CHECK(i >= 0 && i < static_cast<int64_t>(params.size()), "Reducer: held parameter ",
              i, " out of range");
    hold[i] = 1;
  }
  // A parameter that no backward of the last step touched is final already.
  if (!expected_fires.empty())
    for (size_t i = 0; i < params.size(); ++i)
      if (!hold[i] && expected_fires[i] == 0) mark_ready_locked(static_cast<int64_t>(i));
}

void Reducer::Impl::on_pipeline_fire_locked(int64_t i) {
  ++fires[i];
  if (ready[i]) {
    ++stale;
  } else if (!hold[i] && !expected_fires.empty() && fires[i] == expected_fires[i]) {
    mark_ready_locked(i);
    if (opts.overlapping) launch_ready_locked();
  }
}

// Checks the stale count before writing back.
void Reducer::Impl::finalize_pipeline(std::unique_lock<std::mutex>& lock,
                                      std::vector<CommQueue::TicketPtr>& waits,
                                      const CommQueue::TicketPtr& bitmap_t, ReducerStats& st) {
  auto t0 = Clock::now();
  for (size_t b = 0; b < waits.size(); ++b) await_bucket(b, waits[b]);
  wait_ticket(bitmap_t);
  check_failed_ranks();
  if (bitmap_slots.late_fires(bitmap.data_ptr<int32_t>()) > 0) {
    lock.lock();
    st.redone = true;
    redo_all_locked();
    waits = tickets;
    lock.unlock();
    for (size_t b = 0; b < waits.size(); ++b) await_bucket(b, waits[b]);
  }
  for (size_t b = 0; b < waits.size(); ++b) st.comm_ms += runs[b]->comm_ms();
  st.wait_ms += detail::ms_since(t0);
  auto t1 = Clock::now();
  for (size_t b = 0; b < waits.size(); ++b) write_back(b, nullptr);
  st.write_back_ms += detail::ms_since(t1);
  expected_fires = fires;
  waits.clear();  // done: finalize() has no bucket left to wait for
}

// Every bucket again from .grad (the tail is not sent again). Holds mu.
void Reducer::Impl::redo_all_locked() {
  std::fill(ready.begin(), ready.end(), 0);
  std::fill(used.begin(), used.end(), 0);
  for (auto& bk : buckets) bk.pending = bk.params.size();
  next_launch = 0;
  for (size_t i = 0; i < params.size(); ++i) mark_ready_locked(static_cast<int64_t>(i));
  while (next_launch < buckets.size()) launch_locked(next_launch++, false);
}

void Reducer::prepare_for_pipeline_backward(double grad_scale,
                                            const std::vector<int64_t>& hold) {
  impl_->prepare_pipeline(grad_scale, hold);
}

}  // namespace smp
