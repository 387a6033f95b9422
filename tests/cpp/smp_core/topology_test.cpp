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

// The SMP docs' tables for 8 ranks with tp=2, pp=2, rdp=2.
TEST(Topology, TensorParallelMatchesSmpDocs) {
  Topology dpt(8, 2, "DPT", 2);
  Topology ptd(8, 2, "PTD", 2);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(dpt.rdp_rank(r), r / 4) << r;
    EXPECT_EQ(dpt.pp_rank(r), (r / 2) % 2) << r;
    EXPECT_EQ(dpt.tp_rank(r), r % 2) << r;
    EXPECT_EQ(ptd.rdp_rank(r), r % 2) << r;
    EXPECT_EQ(ptd.pp_rank(r), r / 4) << r;
    EXPECT_EQ(ptd.tp_rank(r), (r / 2) % 2) << r;
  }
  EXPECT_EQ(dpt.tp_size(), 2);
  EXPECT_EQ(dpt.rdp_size(), 2);
  EXPECT_EQ(dpt.dp_size(), 4);
  EXPECT_EQ(dpt.mp_size(), 4);
  EXPECT_EQ(dpt.all_tp_groups(), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(dpt.all_pp_groups(), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(dpt.all_rdp_groups(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(dpt.all_dp_groups(), (Groups{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  EXPECT_EQ(dpt.all_mp_groups(), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(dpt.dp_rank(5), 3);
  EXPECT_EQ(dpt.global_rank(1, 2), 6);
  EXPECT_EQ(dpt.global_rank_of(1, 1, 1), 7);
}

// With tp = 1 nothing changes: tp groups are single ranks, rdp == dp and mp == pp.
TEST(Topology, TensorParallelOneIsTheOldLayout) {
  for (const char* placement : {"cluster", "spread", "PDT", "TDP"}) {
    for (int world : {1, 2, 4, 6, 8}) {
      for (int pp : {1, 2, 4}) {
        if (world % pp) continue;
        Topology t(world, pp, placement);
        EXPECT_EQ(t.all_rdp_groups(), t.all_dp_groups());
        EXPECT_EQ(t.all_mp_groups(), t.all_pp_groups());
        for (int r = 0; r < world; ++r) {
          EXPECT_EQ(t.tp_group(r), std::vector<int>{r});
          EXPECT_EQ(t.rdp_rank(r), t.dp_rank(r));
          EXPECT_EQ(t.mp_rank(r), t.pp_rank(r));
        }
      }
    }
  }
}

// For every (world, pp, tp, placement): each kind of group partitions the world, the
// groups' sizes are the degrees, a rank's coordinates name it, and tp x rdp = dp.
TEST(Topology, TensorParallelGroupsPartitionTheWorld) {
  for (const char* placement : {"DPT", "DTP", "PDT", "PTD", "TDP", "TPD"}) {
    for (int world : {2, 4, 8, 12, 16}) {
      for (int pp : {1, 2, 4}) {
        for (int tp : {1, 2, 4}) {
          if (world % (pp * tp)) continue;
          Topology t(world, pp, placement, tp);
          const int rdp = world / (pp * tp);
          for (auto [groups, size] :
               {std::make_pair(t.all_pp_groups(), pp), std::make_pair(t.all_tp_groups(), tp),
                std::make_pair(t.all_rdp_groups(), rdp), std::make_pair(t.all_dp_groups(), tp * rdp),
                std::make_pair(t.all_mp_groups(), pp * tp)}) {
            std::set<int> seen;
            for (auto& g : groups) {
              EXPECT_EQ(static_cast<int>(g.size()), size);
              seen.insert(g.begin(), g.end());
            }
            EXPECT_EQ(static_cast<int>(seen.size()), world);
          }
          for (int r = 0; r < world; ++r) {
            EXPECT_EQ(t.global_rank_of(t.pp_rank(r), t.tp_rank(r), t.rdp_rank(r)), r);
            EXPECT_EQ(t.global_rank(t.pp_rank(r), t.dp_rank(r)), r);
            EXPECT_EQ(t.pp_group(r)[t.pp_rank(r)], r);
            EXPECT_EQ(t.dp_group(r)[t.dp_rank(r)], r);
            EXPECT_EQ(t.mp_group(r)[t.mp_rank(r)], r);
          }
        }
      }
    }
  }
}

TEST(Topology, Errors) {
  EXPECT_THROW(Topology(6, 4), ConfigError);
  EXPECT_THROW(Topology(4, 2, "far"), ConfigError);
  EXPECT_THROW(Topology(4, 2).pp_rank(4), std::out_of_range);
  EXPECT_THROW(Topology(8, 2, "cluster", 3), ConfigError);
  try {
    Topology(8, 2, "cluster", 3);
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "smp: config 'tensor_parallel_degree'=3 does not divide the world "
                           "size 8 / 'partitions'=2 = 4 (allowed: a divisor of 4)");
  }
  try {
    Topology(6, 4);
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "smp: config 'partitions'=4 does not divide the world size 6 "
                           "(allowed: a divisor of 6)");
  }
}

}  // namespace
}  // namespace smp
