// The dispatcher's counters (Dispatcher::Stats in dispatch.h): where a served
// request's time goes, the Python<->C++ crossings, and the served backwards' spans.
// Part of Dispatcher::Impl (detail/dispatcher_impl.h); the counters are bumped where
// their events happen, in the concepts' own files.
//
// Threads: any thread reads them (stats(), take_spans()); record_spans() and
// set_spawn_crosses() are called by the owner between steps. State: `stats` and the
// spans under `mu`; `crossings` an atomic, bumped without it (crossed()) on every
// entry from Python and every callback into it.
#include <tuple>
#include <utility>
#include <vector>

#include "smp_core/detail/dispatcher_impl.h"

namespace smp {

void Dispatcher::set_spawn_crosses(bool crosses) { impl_->spawn_crosses = crosses; }

Dispatcher::Stats Dispatcher::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Stats s = impl_->stats;
  s.crossings = impl_->crossings.load();
  return s;
}

void Dispatcher::record_spans(bool on) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->spans_on = on;
  if (!on) impl_->spans.clear();
}

std::vector<std::tuple<int64_t, double, double>> Dispatcher::take_spans() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return std::exchange(impl_->spans, {});
}

}  // namespace smp
