#include "smp_core/join.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "smp_core/errors.h"

namespace smp {

JoinProtocol::JoinProtocol(ProcessGroupPtr pg, double timeout_s, std::string group_name)
    : pg_(std::move(pg)), timeout_s_(timeout_s) {
  SMP_CHECK(pg_, "JoinProtocol: process group is null");
  if (!(timeout_s_ > 0))
    throw ConfigError(str_cat("smp: JoinProtocol: timeout_s=", timeout_s_, " is not > 0"));
  rank_ = pg_->getRank();
  size_ = pg_->getSize();
  group_ = str_cat("the ", group_name, " process group (", pg_->getBackendName(), ", rank ",
                   rank_, " of ", size_, ")");
}

int64_t JoinProtocol::allreduce(int64_t value, bool max, const std::string& what) {
  std::vector<at::Tensor> v{at::full({1}, value, at::kLong)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  wait_work(pg_->allreduce(v, opts), timeout_s_,
            str_cat(what, " of join iteration ", iteration_, " on ", group_));
  return v[0].item<int64_t>();
}

// Note [Join under tensor parallelism]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under tensor_parallel_degree > 1 the dp group spans tp x rdp ranks, and the tp ranks
// of one replica (a tp group) meet in the collectives inside every distributed module
// (docs/tensor_parallel.md). So a replica runs out of batches as a whole: all its tp
// ranks join in the same iteration, and its shadow steps then issue the reducer's
// collectives on both of its groups (dp and rdp buckets, in bucket order, Note [Slices
// reduce over their rdp group]) exactly as the active replicas' steps do. A replica
// whose tp ranks disagree (one has a batch, another has none) cannot be shadowed: the
// active one would wait inside its forward for a tp peer that never comes. So each
// "not joined" allreduce carries every rank's state (a vector over the group, not a
// count), every rank sees the same vector, and every rank raises the same ConfigError
// at the first iteration where a replica disagrees, instead of hanging.
void JoinProtocol::set_replicas(std::vector<int> replica_of, int tp_degree) {
  if (!replica_of.empty() && static_cast<int>(replica_of.size()) != size_)
    throw ConfigError(str_cat("smp: JoinProtocol.set_replicas: ", replica_of.size(),
                              " entries for a group of ", size_, " ranks"));
  replica_of_ = std::move(replica_of);
  tp_degree_ = tp_degree;
}

int64_t JoinProtocol::not_joined(bool active, const std::string& what) {
  ++iteration_;
  if (replica_of_.empty()) return allreduce(active ? 1 : 0, false, what);
  std::vector<at::Tensor> v{at::zeros({size_}, at::kLong)};
  v[0][rank_] = active ? 1 : 0;
  wait_work(pg_->allreduce(v), timeout_s_,
            str_cat(what, " of join iteration ", iteration_, " on ", group_));
  const auto flags = v[0].contiguous();
  const int64_t* f = flags.data_ptr<int64_t>();
  int64_t n = 0;
  std::string bad;
  for (int r = 0; r < size_; ++r) {
    n += f[r];
    for (int q = 0; q < r; ++q) {
      if (replica_of_[q] != replica_of_[r] || f[q] == f[r]) continue;
      const int on = f[q] ? q : r, off = f[q] ? r : q;
      if (bad.empty())
        bad = str_cat("dp rank ", on, " still has batches but dp rank ", off,
                      " of the same replica (tp group) has run out");
    }
  }
  if (!bad.empty())
    throw ConfigError(str_cat(
        "smp.join: under config 'tensor_parallel_degree'=", tp_degree_, " every tp rank "
        "of a replica must join (run out of batches) in the same iteration of the join "
        "context (model.join() / smp.join.Join), since the tp ranks meet in the "
        "collectives inside distributed modules; in join iteration ", iteration_, " on ",
        group_, " ", bad, ". Give every tp rank of a replica the same number of batches"));
  return n;
}

int64_t JoinProtocol::notify_not_joined() {
  return not_joined(true, "the 'not joined' allreduce (this rank has data)");
}

int64_t JoinProtocol::count_not_joined() {
  return not_joined(false, "the 'not joined' allreduce (this rank has joined)");
}

bool JoinProtocol::check_early_termination(bool joined) {
  return allreduce(joined ? 1 : 0, false, "the early-termination allreduce") > 0;
}

int64_t JoinProtocol::find_common_rank(bool candidate) {
  return allreduce(candidate ? rank_ : -1, true, "the common-rank allreduce");
}

int64_t JoinProtocol::allreduce_sum(int64_t value, const std::string& what) {
  return allreduce(value, false, what);
}

}  // namespace smp
