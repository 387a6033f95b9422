// Rank layout of a job: world = pp x dp (x tp, always 1 here), mapped as SMP v1 maps it.
//
// placement_strategy is read as a permutation of the letters D (data), P (pipeline),
// T (tensor): the rightmost letter varies fastest over consecutive global ranks.
// "cluster" = "DPT" (a replica's stages sit on consecutive ranks), "spread" = "TPD".
// Example, 8 ranks, partitions=2: cluster -> pp groups {0,1},{2,3},..., dp groups
// {0,2,4,6},{1,3,5,7}; spread -> dp groups {0,1,2,3},{4,5,6,7}, pp groups {0,4},...
//
// A Topology is an immutable value: safe to share between threads.
#pragma once

#include <string>
#include <vector>

namespace smp {

class Topology {
 public:
  // Throws ConfigError if pp does not divide world_size or placement is unknown.
  Topology(int world_size, int pp_size, const std::string& placement = "cluster");

  int world_size() const { return world_; }
  int pp_size() const { return pp_; }
  int dp_size() const { return dp_; }
  int tp_size() const { return 1; }

  int pp_rank(int rank) const;
  int dp_rank(int rank) const;
  // Global rank of (pp_rank, dp_rank).
  int global_rank(int pp_rank, int dp_rank) const;

  // Members of `rank`'s groups, in group-rank order.
  std::vector<int> pp_group(int rank) const;  // = mp group (tp is 1)
  std::vector<int> dp_group(int rank) const;  // = rdp group

  // Every group of a kind, ordered by the smallest member; every rank must create
  // process groups in exactly this order.
  std::vector<std::vector<int>> all_pp_groups() const;
  std::vector<std::vector<int>> all_dp_groups() const;

  // Printable grid "rank: pp=.. dp=.." for logs and errors.
  std::string describe() const;

 private:
  void check_rank(int rank) const;

  int world_, pp_, dp_;
  // Strides of each axis in global rank space.
  int pp_stride_, dp_stride_;
};

}  // namespace smp
