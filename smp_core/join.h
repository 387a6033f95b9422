// JoinProtocol: the collectives of the Join context (smp.join.Join) for uneven inputs,
// on one data-parallel process group. See docs/join.md.
//
// Each iteration of training, every rank of the group issues the same sequence:
//   active rank:  notify_not_joined()           joined rank: count_not_joined()
//   [throw_on_early_termination]
//   active rank:  check_early_termination(false) joined rank: check_early_termination(true)
// then the Joinables' own per-step collectives (a model's step or its shadow). Each
// call is one 1-element allreduce of int64 (sum, or max for find_common_rank).
//
// Note [Join collective order]
// The join collectives are issued from the training thread between steps, not from the
// reducer's comm queue: at that point the queue is idle on every rank (finalize() and
// run_shadow_step() return only after every task of the step finished), so each rank's
// sequence on the group is [step k's buckets, bitmap, ...][join collectives of k+1]
// [step k+1's ...]. Issuing from the queue would gain nothing (nothing to overlap) and
// would make a failed join allreduce poison the reducer. The training thread is also
// the only thread that issues a collective on the group between steps.
//
// Threads: one training thread per rank. Every call blocks up to `timeout_s` and
// throws TimeoutError/CommError naming the collective, the group and the iteration.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "smp_core/comm.h"

namespace smp {

class JoinProtocol {
 public:
  // `group_name` names the group in errors ("dp").
  JoinProtocol(ProcessGroupPtr pg, double timeout_s = 300.0, std::string group_name = "dp");

  // Note [Join under tensor parallelism] (join.cpp): `replica_of[r]` names the replica
  // (the tp group) of group rank r; from then on each "not joined" allreduce carries
  // every rank's state, and a replica whose ranks differ (some joined, some not) is a
  // ConfigError on every rank of the group, naming `tp_degree`. Empty: off (tp = 1).
  void set_replicas(std::vector<int> replica_of, int tp_degree);

  // Active rank, once per iteration: contributes 1 to the "not joined" allreduce and
  // returns how many ranks of the group are still active (this one included).
  int64_t notify_not_joined();
  // Joined rank, once per iteration of the join loop: contributes 0; returns the number
  // of ranks still active (0: every rank joined).
  int64_t count_not_joined();
  // throw_on_early_termination: active ranks pass false, joined ranks true; returns
  // whether any rank of the group has joined.
  bool check_early_termination(bool joined);
  // The largest group rank among those passing candidate=true (-1 if none).
  int64_t find_common_rank(bool candidate);
  // Sum of `value` over the group; `what` names it in errors.
  int64_t allreduce_sum(int64_t value, const std::string& what);

  // Iterations seen so far (calls of notify_not_joined + count_not_joined).
  int64_t iteration() const { return iteration_; }
  int rank() const { return rank_; }
  double timeout_s() const { return timeout_s_; }
  int size() const { return size_; }
  const ProcessGroupPtr& process_group() const { return pg_; }

 private:
  int64_t allreduce(int64_t value, bool max, const std::string& what);
  // The "not joined" allreduce of this iteration (Note [Join under tensor parallelism]).
  int64_t not_joined(bool active, const std::string& what);

  ProcessGroupPtr pg_;
  double timeout_s_;
  std::string group_;  // "the dp process group (gloo, rank 0 of 2)"
  int rank_ = 0, size_ = 1;
  int64_t iteration_ = 0;
  std::vector<int> replica_of_;  // per group rank; empty: tp = 1
  int tp_degree_ = 1;
};

}  // namespace smp
