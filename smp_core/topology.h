// Rank layout of a job: world = pp x tp x rdp, mapped as SMP v1 maps it.
//
// placement_strategy is read as a permutation of the letters D (reduced data), P
// (pipeline), T (tensor): the rightmost letter varies fastest over consecutive global
// ranks. "cluster" = "DPT" (a replica's stages sit on consecutive ranks), "spread" =
// "TPD". Example, 8 ranks, partitions=2, tp=1: cluster -> pp groups {0,1},{2,3},...,
// dp groups {0,2,4,6},{1,3,5,7}; spread -> dp groups {0,1,2,3},{4,5,6,7}, pp groups
// {0,4},...
//
// Groups, as SMP names them (Note [Groups under tensor parallelism]):
//   pp:  the ranks of one model replica's stages, one per pp rank (same tp and rdp rank);
//   tp:  the ranks that split the same stage's distributed modules (same pp and rdp rank);
//   rdp: the ranks that hold the same slice of the same stage (same pp and tp rank);
//   dp:  every rank of a stage, tp x rdp (same pp rank): where non-distributed
//        parameters are reduced; dp == rdp when tp is 1;
//   mp:  one replica, pp x tp (same rdp rank); mp == pp when tp is 1.
// Members are listed in ascending global rank, except pp groups, listed by pp rank;
// a rank's index in its dp group is its dp rank (SMP's).
//
// A Topology is an immutable value: safe to share between threads.
#pragma once

#include <string>
#include <vector>

namespace smp {

class Topology {
 public:
  // Throws ConfigError if pp x tp does not divide world_size or placement is unknown.
  Topology(int world_size, int pp_size, const std::string& placement = "cluster",
           int tp_size = 1);

  int world_size() const { return world_; }
  int pp_size() const { return pp_; }
  int tp_size() const { return tp_; }
  int rdp_size() const { return rdp_; }
  int dp_size() const { return tp_ * rdp_; }
  int mp_size() const { return pp_ * tp_; }

  int pp_rank(int rank) const;
  int tp_rank(int rank) const;
  int rdp_rank(int rank) const;
  int dp_rank(int rank) const;  // index in its dp group
  int mp_rank(int rank) const;  // index in its mp group
  // Global rank of (pp_rank, dp_rank).
  int global_rank(int pp_rank, int dp_rank) const;
  // Global rank of (pp_rank, tp_rank, rdp_rank).
  int global_rank_of(int pp_rank, int tp_rank, int rdp_rank) const;

  // Members of `rank`'s groups, in group-rank order.
  std::vector<int> pp_group(int rank) const;
  std::vector<int> tp_group(int rank) const;
  std::vector<int> rdp_group(int rank) const;
  std::vector<int> dp_group(int rank) const;
  std::vector<int> mp_group(int rank) const;

  // Every group of a kind, ordered by the smallest member; every rank must create
  // process groups in exactly this order.
  std::vector<std::vector<int>> all_pp_groups() const;
  std::vector<std::vector<int>> all_tp_groups() const;
  std::vector<std::vector<int>> all_rdp_groups() const;
  std::vector<std::vector<int>> all_dp_groups() const;
  std::vector<std::vector<int>> all_mp_groups() const;

  // Printable grid "rank: pp=.. dp=.." (and tp, rdp when tp > 1) for logs and errors.
  std::string describe() const;

  // Note [A tp group on one host]: with the placement putting tp innermost (T last:
  // "cluster", "DPT", "PDT"), each tp group is meant to sit on one host; throws
  // ConfigError naming the group, its hosts and the alternatives when `host_of_rank`
  // (a host identity per global rank) shows one that spans hosts.
  void check_tp_hosts(const std::vector<std::string>& host_of_rank) const;

 private:
  void check_rank(int rank) const;
  // Every group `group_of` gives, once, ordered by the smallest member.
  template <typename F>
  std::vector<std::vector<int>> all_groups(F group_of) const;

  int world_, pp_, tp_, rdp_;
  std::string placement_;
  // Strides of each axis in global rank space.
  int pp_stride_ = 1, tp_stride_ = 1, rdp_stride_ = 1;
};

}  // namespace smp
