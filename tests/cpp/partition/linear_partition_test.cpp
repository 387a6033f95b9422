// The exact contiguous splitter against brute force with the full tie-break of
// Note [Tie-break], on small integer weights (many exact ties).
#include "partition/detail/linear_partition.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <tuple>

namespace smp::partition::detail {
namespace {

struct Split {
  std::vector<int> cuts;  // start of runs 1..s-1
  int64_t worst = 0;
  int64_t pen = 0;
  int64_t squares = 0;
};

std::vector<Split> all_splits(const std::vector<int64_t>& w, const std::vector<int>& pen, int s) {
  const int n = static_cast<int>(w.size());
  std::vector<Split> out;
  std::vector<int> cuts;
  std::function<void(int)> rec = [&](int from) {
    if (static_cast<int>(cuts.size()) == s - 1) {
      Split sp;
      sp.cuts = cuts;
      int start = 0;
      for (int k = 0; k < s; ++k) {
        const int end = k < s - 1 ? cuts[k] : n;
        int64_t sum = 0;
        for (int t = start; t < end; ++t) sum += w[t];
        sp.worst = std::max(sp.worst, sum);
        sp.squares += sum * sum;
        if (k > 0) sp.pen += pen[start];
        start = end;
      }
      out.push_back(sp);
      return;
    }
    for (int c = from; c <= n - (s - 1 - static_cast<int>(cuts.size())); ++c) {
      cuts.push_back(c);
      rec(c + 1);
      cuts.pop_back();
    }
  };
  rec(1);
  return out;
}

// The split Note [Tie-break] prescribes.
Split reference(const std::vector<int64_t>& w, const std::vector<int>& pen, int s, double slack) {
  const auto splits = all_splits(w, pen, s);
  int64_t opt = splits.front().worst;
  for (const auto& sp : splits) opt = std::min(opt, sp.worst);
  const int64_t cap = opt + static_cast<int64_t>(std::floor(static_cast<long double>(opt) * slack));
  const Split* best = nullptr;
  auto key = [](const Split& sp) {
    std::vector<int> rev(sp.cuts.rbegin(), sp.cuts.rend());  // earliest last cut first
    return std::make_tuple(sp.pen, sp.squares, rev);
  };
  for (const auto& sp : splits) {
    if (sp.worst > cap) continue;
    if (best == nullptr || key(sp) < key(*best)) best = &sp;
  }
  return *best;
}

std::vector<int> cuts_of(const std::vector<int>& stage) {
  std::vector<int> cuts;
  for (size_t i = 1; i < stage.size(); ++i) {
    if (stage[i] != stage[i - 1]) cuts.push_back(static_cast<int>(i));
  }
  return cuts;
}

TEST(LinearPartition, MatchesBruteForceWithTieBreak) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 1500; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int n = std::uniform_int_distribution<int>(1, 10)(rng);
    const int s = std::uniform_int_distribution<int>(1, std::min(n, 5))(rng);
    const int wmax = trial % 3 == 0 ? 1 : (trial % 3 == 1 ? 4 : 100);
    std::vector<int64_t> w(n);
    std::vector<int> pen(n, 0);
    for (auto& x : w) x = std::uniform_int_distribution<int>(0, wmax)(rng);
    for (int i = 1; i < n; ++i) pen[i] = std::uniform_int_distribution<int>(0, 3)(rng);
    const double slacks[] = {0.0, 0.0, 0.1, 0.5};
    const double slack = slacks[trial % 4];

    const Split want = reference(w, pen, s, slack);
    const LinearSplit got = split_contiguous(w, pen, s, slack);
    EXPECT_EQ(cuts_of(got.stage), want.cuts);
    EXPECT_EQ(got.bottleneck, want.worst);
    EXPECT_EQ(got.penalty, want.pen);
    EXPECT_EQ(got.stage.front(), 0);
    EXPECT_EQ(got.stage.back(), s - 1);
    EXPECT_EQ(got.optimum, min_bottleneck(w, s));
  }
}

TEST(LinearPartition, ClosedForms) {
  // n equal items into s stages: bottleneck ceil(n / s).
  for (int n = 1; n <= 12; ++n) {
    for (int s = 1; s <= n; ++s) {
      EXPECT_EQ(min_bottleneck(std::vector<int64_t>(n, 1), s), (n + s - 1) / s) << n << "/" << s;
    }
  }
  EXPECT_EQ(min_bottleneck({1, 2, 3, 4, 5, 6, 7, 8, 9}, 3), 17);
  EXPECT_EQ(min_bottleneck({0, 0, 0}, 2), 0);
  // All-zero weights: every split ties; the penalties decide.
  const LinearSplit z = split_contiguous({0, 0, 0, 0}, {0, 2, 0, 1}, 2, 0.0);
  EXPECT_EQ(z.stage, (std::vector<int>{0, 0, 1, 1}));
}

}  // namespace
}  // namespace smp::partition::detail
