#include "smp_core/topology.h"

#include <gtest/gtest.h>

#include <set>

#include "smp_core/errors.h"

namespace smp {
namespace {

using Groups = std::vector<std::vector<int>>;

TEST(Topology, ClusterMatchesSmpDocs) {
  Topology t(8, 2, "cluster");
  EXPECT_EQ(t.dp_size(), 4);
  EXPECT_EQ(t.all_pp_groups(), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(t.all_dp_groups(), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(t.pp_rank(5), 1);
  EXPECT_EQ(t.dp_rank(5), 2);
  EXPECT_EQ(t.pp_group(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(t.dp_group(5), (std::vector<int>{1, 3, 5, 7}));
}

TEST(Topology, SpreadMatchesSmpDocs) {
  Topology t(8, 2, "spread");
  EXPECT_EQ(t.all_pp_groups(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(t.all_dp_groups(), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(t.dp_rank(6), 2);  // SMP docs: "the dp_rank of process 6 is 2"
  EXPECT_EQ(t.pp_rank(6), 1);
}

TEST(Topology, LetterPermutationsEqualNamedStrategies) {
  for (int world : {1, 2, 4, 6, 8, 12}) {
    for (int pp : {1, 2, 3, 4}) {
      if (world % pp) continue;
      EXPECT_EQ(Topology(world, pp, "DPT").all_pp_groups(), Topology(world, pp, "cluster").all_pp_groups());
      EXPECT_EQ(Topology(world, pp, "TPD").all_dp_groups(), Topology(world, pp, "spread").all_dp_groups());
      EXPECT_EQ(Topology(world, pp, "PDT").all_dp_groups(), Topology(world, pp, "spread").all_dp_groups());
    }
  }
}

// Invariants for every (world, pp, placement): groups partition the world, a rank's
// pp and dp groups intersect in exactly itself, and global_rank inverts the ranks.
TEST(Topology, GroupsPartitionTheWorld) {
  for (const char* placement : {"cluster", "spread"}) {
    for (int world = 1; world <= 12; ++world) {
      for (int pp = 1; pp <= world; ++pp) {
        if (world % pp) continue;
        Topology t(world, pp, placement);
        std::multiset<int> seen_pp, seen_dp;
        for (auto& g : t.all_pp_groups()) {
          EXPECT_EQ(static_cast<int>(g.size()), pp);
          seen_pp.insert(g.begin(), g.end());
        }
        for (auto& g : t.all_dp_groups()) {
          EXPECT_EQ(static_cast<int>(g.size()), world / pp);
          seen_dp.insert(g.begin(), g.end());
        }
        EXPECT_EQ(static_cast<int>(seen_pp.size()), world);
        EXPECT_EQ(static_cast<int>(std::set<int>(seen_pp.begin(), seen_pp.end()).size()), world);
        EXPECT_EQ(static_cast<int>(std::set<int>(seen_dp.begin(), seen_dp.end()).size()), world);
        for (int r = 0; r < world; ++r) {
          EXPECT_EQ(t.global_rank(t.pp_rank(r), t.dp_rank(r)), r);
          EXPECT_EQ(t.pp_group(r)[t.pp_rank(r)], r);
          EXPECT_EQ(t.dp_group(r)[t.dp_rank(r)], r);
        }
      }
    }
  }
}

TEST(Topology, Errors) {
  EXPECT_THROW(Topology(6, 4), ConfigError);
  EXPECT_THROW(Topology(4, 2, "far"), ConfigError);
  EXPECT_THROW(Topology(4, 2).pp_rank(4), std::out_of_range);
  try {
    Topology(6, 4);
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "smp: config 'partitions'=4 does not divide the world size 6 "
                           "(allowed: a divisor of 6)");
  }
}

}  // namespace
}  // namespace smp
