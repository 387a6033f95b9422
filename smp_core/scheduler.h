// The pipeline schedule as data: the one place that decides in which order a rank
// runs the forward and backward work of a step's microbatches.
//
// The runtime (python/smp/pipeline.py and smp_core/p2p) asks a Schedule for
//   - priority(mb, phase): the rank's compute token goes to the waiting task with the
//     smallest value (Note [Compute token] in p2p.h), and a serving rank takes the
//     pending request with the smallest value first (Note [Receive order]);
//   - window(): how many microbatches the driver keeps in flight;
//   - forwards_before_backwards(): whether backward waits for every forward ("simple").
// plan() runs the same rules on a model of the step (each microbatch's forward visits
// the stages of `path` in turn; its backward visits them in reverse) with unit-cost
// work, and returns what every stage runs in every time slot: a grid that can be
// printed, compared and checked without processes (deadlock, order, window).
//
// Thread-safety: a Schedule is immutable after construction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace smp {

enum class ScheduleKind : int32_t {
  kInterleaved = 0,  // a ready backward before a new forward; window of microbatches
  kSimple = 1,       // every forward, then every backward (GPipe)
  kOneFOneB = 2,     // interleaved's rule with 1F1B's window: one microbatch per pp rank
  // 1F1B whose served backwards split into I and W, W placed by the plan (Note [Split
  // backward] in smp_core/detail/split_backward.h); in the dynamic order (the first
  // step, a step that leaves its plan) it runs as 1f1b.
  kZeroBubble = 3,
};

// "interleaved", "simple", "1f1b", "zero_bubble" (config 'pipeline').
const char* schedule_kind_name(ScheduleKind kind);

enum class Phase : int32_t { kForward = 0, kBackward = 1 };

// One unit of work: microbatch `mb`'s `phase` at `hop` (the hop-th stage its forward
// visits). hop is -1 where not known (a live task).
struct Work {
  int64_t mb = 0;
  Phase phase = Phase::kForward;
  int64_t hop = 0;
  bool operator==(const Work& o) const {
    return mb == o.mb && phase == o.phase && hop == o.hop;
  }
};

struct ScheduleOptions {
  // Config 'pipeline' (see smp_core/plan.h for the plans of each kind).
  ScheduleKind kind = ScheduleKind::kInterleaved;
  // Microbatches per step (config 'microbatches').
  int64_t microbatches = 1;
  // Pipeline stages = pp ranks (config 'partitions').
  int64_t stages = 1;
  // Microbatches in flight on the driver under "interleaved" (config
  // 'active_microbatches'); "simple" runs every microbatch at once.
  int64_t active_microbatches = 3;
};

// 1F1B's and zero_bubble's window: the driver's task threads (Note [1F1B's window] in
// scheduler.cpp), pp ranks + 1 where there is a pipeline; a Plan's is at most this.
int64_t one_f_one_b_window(int64_t stages, int64_t microbatches);

// The priority rule alone, for callers that only have the kind (the p2p receive order).
int64_t schedule_priority(ScheduleKind kind, int64_t mb, Phase phase);

// A cell of the step x rank table to mark: (stage, microbatch, phase).
struct FailedCell {
  int64_t stage = -1;
  int64_t mb = -1;
  Phase phase = Phase::kForward;
  bool weight = false;  // zero_bubble: the backward's W failed (Plan's marking; the grid shows B)
};

class Schedule {
 public:
  // Throws ConfigError naming the option, value and allowed values.
  explicit Schedule(ScheduleOptions options);

  const ScheduleOptions& options() const { return options_; }

  // Lower runs first. interleaved: backward work before a new forward, earlier
  // microbatches first; simple: every forward first, earlier microbatches first.
  int64_t priority(int64_t mb, Phase phase) const {
    return schedule_priority(options_.kind, mb, phase);
  }
  int64_t window() const;
  bool forwards_before_backwards() const { return options_.kind == ScheduleKind::kSimple; }

  // What each stage runs in each time slot, for microbatches whose forward visits the
  // stages in `path` (empty: 0, 1, ..., stages-1; a path such as {0, 1, 0} models a
  // nested call back into the driver). plan()[stage][slot] is the work or, with
  // mb == -1, an idle slot. Throws std::logic_error naming the stuck work if the rules
  // deadlock (a cycle the runtime could not leave either).
  std::vector<std::vector<Work>> plan(const std::vector<int64_t>& path = {}) const;

  // The plan as a grid: one row per stage, "F3" / "B3" (microbatch 3) or "." per slot.
  // With `failed`, the first cell of that stage, microbatch and phase is shown as
  // "[F3]" and a line below says what failed.
  std::string grid(const std::vector<int64_t>& path = {},
                   const FailedCell* failed = nullptr) const;

 private:
  ScheduleOptions options_;
};

}  // namespace smp
