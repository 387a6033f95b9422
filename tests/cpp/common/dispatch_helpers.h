// Test helpers for the pipeline's dispatcher (smp_core/dispatch.h): messages, schedules
// and a spawn that runs each body on a thread of its own. Header-only; used by the
// dispatcher's tests (tests/cpp/smp_core/dispatch_test.cpp and the tests of its parts).
#pragma once

#include <cstdint>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "smp_core/p2p.h"
#include "smp_core/scheduler.h"

namespace smp::testing {

constexpr uint32_t bit(int kind) { return 1u << kind; }

inline Message make(int64_t mb, int64_t call, int32_t kind, std::vector<at::Tensor> tensors = {}) {
  Message m;
  m.mb = mb, m.call_id = call, m.kind = kind;
  m.tensors = std::move(tensors);
  return m;
}

inline Schedule schedule(ScheduleKind kind, int64_t mbs, int64_t stages, int64_t active = 3) {
  return Schedule(ScheduleOptions{kind, mbs, stages, active});
}

// Runs every spawned body on a detached thread of its own; the dispatcher joins them.
inline void spawn_thread(std::function<void()> body) { std::thread(std::move(body)).detach(); }

// The answer a test handler gives: the request's first tensor times 2 (forward) or 3.
inline Message answer_of(const Message& req) {
  const bool fwd = req.kind == kRequest;
  return make(0, 0, fwd ? kResponse : kBackwardResponse, {req.tensors.at(0) * (fwd ? 2 : 3)});
}

}  // namespace smp::testing
