// The dependency rules of a plan's compute actions, shared by compiling a plan
// (plan.cpp: list scheduling) and checking one (plan_validate.cpp).
//
// Thread-safety: pure functions and a value type.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "smp_core/errors.h"
#include "smp_core/plan.h"

namespace smp::detail::plan_rules {

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

inline bool is_compute(Op op) { return op <= Op::kBackwardWeight; }
// B and I are what the previous hop's backward waits for.
inline bool is_backward_input(Op op) { return op == Op::kBackward || op == Op::kBackwardInput; }
// B and W add to the parameters' gradients (Note [Gradient order]); I does not.
inline bool accumulates(Op op) { return op == Op::kBackward || op == Op::kBackwardWeight; }

// When each compute action finished (kNever: not yet), by (microbatch, hop).
struct Done {
  Done(int64_t m, int64_t hops)
      : f(m, std::vector<int64_t>(hops, kNever)), b(f), w(f), forwards_left(m) {}
  std::vector<std::vector<int64_t>> f, b, w;  // b: B or I
  int64_t forwards_left;  // microbatches whose last forward hop has not finished
  int64_t last_forward = 0;  // when the last of them finished

  int64_t& at(const Action& a) {
    return a.op == Op::kForward ? f[a.mb][a.hop] : a.op == Op::kBackwardWeight ? w[a.mb][a.hop]
                                                                              : b[a.mb][a.hop];
  }
  void finish(const Action& a, int64_t t, int64_t hops) {
    at(a) = t;
    if (a.op == Op::kForward && a.hop == hops - 1) {
      --forwards_left;
      last_forward = std::max(last_forward, t);
    }
  }
  // Finishes the running actions (finish time, action) that end by `t`.
  void finish_due(std::vector<std::pair<int64_t, Action>>& running, int64_t t, int64_t hops) {
    for (auto it = running.begin(); it != running.end();) {
      if (it->first <= t) {
        finish(it->second, it->first, hops);
        it = running.erase(it);
      } else {
        ++it;
      }
    }
  }
};

// Note [Plan rules] (dependencies): forward hop h needs forward hop h-1; the backward
// (B or I) of the last hop needs that hop's forward and, under "simple", every
// microbatch's forward; backward hop h needs backward hop h+1; W needs its I.
// Returns when `a` can start (kNever: not known yet).
inline int64_t ready_at(const Action& a, const Done& d, int64_t hops, bool simple) {
  if (a.op == Op::kForward) return a.hop == 0 ? 0 : d.f[a.mb][a.hop - 1];
  if (a.op == Op::kBackwardWeight) return d.b[a.mb][a.hop];
  if (a.hop < hops - 1) return d.b[a.mb][a.hop + 1];
  if (!simple) return d.f[a.mb][a.hop];
  return d.forwards_left == 0 ? std::max(d.last_forward, d.f[a.mb][a.hop]) : kNever;
}

inline std::string awaited(const Action& a, const Done& d, int64_t hops, bool simple) {
  if (a.op == Op::kForward) return str_cat("F", a.mb, " hop ", a.hop - 1);
  if (a.op == Op::kBackwardWeight) return str_cat("I", a.mb, " hop ", a.hop);
  if (a.hop < hops - 1) return str_cat("B/I", a.mb, " hop ", a.hop + 1);
  if (simple && d.forwards_left > 0) return "every microbatch's forward ('simple')";
  return str_cat("F", a.mb, " hop ", a.hop);
}

}  // namespace smp::detail::plan_rules
