// Test helpers for the pipeline's dispatcher (smp_core/dispatch.h): messages, schedules,
// a spawn that runs each body on a thread of its own, and ranks with a P2P engine each.
// Header-only; used by the dispatcher's tests (tests/cpp/smp_core/dispatch_test.cpp and
// the tests of its parts).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "gloo_world.h"
#include "p2p_helpers.h"
#include "smp_core/p2p.h"
#include "smp_core/plan.h"

namespace smp::testing {

// A message without metadata.
inline Message make(int64_t mb, int64_t call, int32_t kind, std::vector<at::Tensor> tensors = {}) {
  return make(mb, call, kind, std::string(), std::move(tensors));
}

// A Dispatcher's options: the step's kind, microbatches, stages and window.
inline PlanOptions schedule(PlanKind kind, int64_t mbs, int64_t stages, int64_t active = 3) {
  return step_options(kind, mbs, stages, active);
}

// Runs every spawned body on a detached thread of its own; the dispatcher joins them.
inline void spawn_thread(std::function<void()> body) { std::thread(std::move(body)).detach(); }

// The answer a test handler gives: the request's first tensor times 2 (forward) or 3.
inline Message answer_of(const Message& req) {
  const bool fwd = req.kind == kRequest;
  return make(0, 0, fwd ? kResponse : kBackwardResponse, {req.tensors.at(0) * (fwd ? 2 : 3)});
}

// Calls fn(rank, p2p) on n ranks (threads, run_gloo_world), each with a P2P engine over
// the world's store under `prefix`, its waits timing out after timeout_s; the engine
// outlives fn.
inline void run_p2p_world(int n, const std::string& prefix, double timeout_s,
                          const std::function<void(int, const std::shared_ptr<P2PEngine>&)>& fn) {
  run_gloo_world(n, [&](int r, const compat::ProcessGroupPtr&, const compat::StorePtr& store) {
    fn(r, std::make_shared<P2PEngine>(store, prefix, r, n, timeout_s));
  });
}

}  // namespace smp::testing
