// Exact contiguous partitioning of a weighted sequence (the "linear partition"
// problem) with a deterministic tie-break. Internal to partition/.
#pragma once

#include <cstdint>
#include <vector>

namespace smp::partition::detail {

// Note [Tie-break]
// Items 0..n-1 (units in execution order, integer weights) are cut into `stages`
// non-empty contiguous runs. Among all such splits the chosen one
//   1. has bottleneck (largest run weight) <= T = B* + floor(B* * slack), B* the
//      optimum (slack = 0: exactly optimal; the arithmetic is integer, so "equal"
//      means equal),
//   2. then has the smallest sum of cut penalties (for units: depth of the lowest
//      common ancestor of the two units a cut separates; cutting between top-level
//      blocks costs 0, inside a block more),
//   3. then the smallest sum of squared run weights (the most even split below the
//      bottleneck),
//   4. then the earliest last cut, then the earliest cut before it, and so on: what
//      is left over goes to later stages (partition 0 also runs the step body and,
//      pipelined, holds the most microbatches in flight).
// B* comes from a binary search over integer bottlenecks with a greedy feasibility
// test, O(n log W); steps 2-4 are one dynamic program over (run, end) restricted to
// runs of weight <= T, O(stages * n * w) with w the widest such run (in items).
struct LinearSplit {
  // Run (stage) of every item; non-decreasing, 0..stages-1, every stage non-empty.
  std::vector<int> stage;
  // Smallest achievable bottleneck B*.
  int64_t optimum = 0;
  // Bottleneck of the chosen split (optimum <= bottleneck <= T).
  int64_t bottleneck = 0;
  // Sum of cut penalties of the chosen split.
  int64_t penalty = 0;
};

// Smallest possible bottleneck of splitting `weights` (each >= 0) into at most
// `stages` >= 1 runs.
int64_t min_bottleneck(const std::vector<int64_t>& weights, int stages);

// Requires 1 <= stages <= weights.size(), weights >= 0, slack >= 0, and
// cut_penalty.size() == weights.size() (cut_penalty[i] >= 0: cutting between items
// i-1 and i; [0] unused).
LinearSplit split_contiguous(const std::vector<int64_t>& weights,
                             const std::vector<int>& cut_penalty, int stages, double slack);

}  // namespace smp::partition::detail
