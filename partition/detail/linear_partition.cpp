#include "partition/detail/linear_partition.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace smp::partition::detail {
namespace {

__extension__ typedef unsigned __int128 Wide;  // sums of squared 2^40-scale weights

// Best way found so far to cover a prefix with some runs; see Note [Tie-break].
struct State {
  bool ok = false;
  int64_t penalty = 0;
  Wide squares = 0;
};

// Greedy: the fewest runs of weight <= cap that cover `weights` (cap >= max weight).
int runs_needed(const std::vector<int64_t>& weights, int64_t cap) {
  int runs = 1;
  int64_t cur = 0;
  for (int64_t w : weights) {
    if (cur + w > cap) {
      ++runs;
      cur = w;
    } else {
      cur += w;
    }
  }
  return runs;
}

}  // namespace

int64_t min_bottleneck(const std::vector<int64_t>& weights, int stages) {
  int64_t lo = 0, hi = 0;
  for (int64_t w : weights) {
    lo = std::max(lo, w);
    hi += w;
  }
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (runs_needed(weights, mid) <= stages) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

LinearSplit split_contiguous(const std::vector<int64_t>& weights,
                             const std::vector<int>& cut_penalty, int stages, double slack) {
  const int n = static_cast<int>(weights.size());
  const int s = stages;
  std::vector<int64_t> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + weights[i];

  LinearSplit out;
  out.optimum = min_bottleneck(weights, s);
  const long double extra = std::floor(static_cast<long double>(out.optimum) * slack);
  const int64_t cap = extra >= static_cast<long double>(prefix[n] - out.optimum)
                          ? prefix[n]
                          : out.optimum + static_cast<int64_t>(extra);

  // best[j]: best cover of items [0, j) by k runs; from[k][j]: start of the k-th run.
  std::vector<State> prev(n + 1), best(n + 1);
  std::vector<std::vector<int>> from(s + 1, std::vector<int>(n + 1, -1));
  for (int j = 1; j <= n - s + 1; ++j) {
    if (prefix[j] > cap) break;
    const Wide w = static_cast<Wide>(prefix[j]);
    best[j] = State{true, 0, w * w};
    from[1][j] = 0;
  }
  for (int k = 2; k <= s; ++k) {
    std::swap(prev, best);
    std::fill(best.begin(), best.end(), State{});
    int lo = 0;
    for (int j = k; j <= n - s + k; ++j) {
      while (prefix[j] - prefix[lo] > cap) ++lo;
      State& b = best[j];
      // Ascending i with strict improvement keeps the earliest cut. Note [Tie-break].
      for (int i = std::max(lo, k - 1); i < j; ++i) {
        if (!prev[i].ok) continue;
        const int64_t pen = prev[i].penalty + cut_penalty[i];
        if (b.ok && pen > b.penalty) continue;  // most candidates stop here, cheaply
        const Wide w = static_cast<Wide>(prefix[j] - prefix[i]);
        const Wide sq = prev[i].squares + w * w;
        if (!b.ok || pen < b.penalty || sq < b.squares) {
          b = State{true, pen, sq};
          from[k][j] = i;
        }
      }
    }
  }

  // cap >= optimum, so a split exists; walk it back from the end.
  out.stage.assign(n, 0);
  out.penalty = best[n].penalty;
  for (int k = s, j = n; k >= 1; --k) {
    const int i = from[k][j];
    for (int t = i; t < j; ++t) out.stage[t] = k - 1;
    out.bottleneck = std::max(out.bottleneck, prefix[j] - prefix[i]);
    j = i;
  }
  return out;
}

}  // namespace smp::partition::detail
