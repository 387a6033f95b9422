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

int64_t JoinProtocol::notify_not_joined() {
  ++iteration_;
  return allreduce(1, false, "the 'not joined' allreduce (this rank has data)");
}

int64_t JoinProtocol::count_not_joined() {
  ++iteration_;
  return allreduce(0, false, "the 'not joined' allreduce (this rank has joined)");
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
