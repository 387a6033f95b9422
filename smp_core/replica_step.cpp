#include "smp_core/replica_step.h"

#include <exception>
#include <utility>

#include "smp_core/errors.h"

namespace smp {

struct ReplicaStep::Impl {
  ProcessGroupPtr pg;
  ReplicaStepOptions opts;
  bool state_synced = false;  // parameters and buffers broadcast from dp rank 0
  int64_t steps = 0;
  bool sync_step = false;     // this step synchronizes
  bool sync_backward = false; // this microbatch's backward reduces
  bool armed = false;         // a synchronized backward began this step
  StorePtr store;             // Note [Failed peer]
  std::string prefix;
  int rank = 0, dp_rank = 0;
};

ReplicaStep::ReplicaStep(ProcessGroupPtr dp, ReplicaStepOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (options.backward_passes_per_step < 1)
    throw ConfigError(str_cat("smp: ReplicaStep backward_passes_per_step=",
                              options.backward_passes_per_step, " must be >= 1"));
  impl_->pg = std::move(dp);
  impl_->opts = options;
}

ReplicaStep::~ReplicaStep() = default;

ForwardSync ReplicaStep::forward_sync(bool has_buffers) const {
  const auto& I = *impl_;
  if (!I.opts.reduces) return ForwardSync::kNothing;
  if (!I.state_synced) return ForwardSync::kState;
  return I.opts.broadcast_buffers && has_buffers ? ForwardSync::kBuffers : ForwardSync::kNothing;
}

ForwardSync ReplicaStep::sync_before_forward(const std::vector<at::Tensor>& params,
                                             const std::vector<at::Tensor>& buffers,
                                             const std::vector<int>& sliced,
                                             const ProcessGroupPtr& slice_group) {
  auto& I = *impl_;
  const ForwardSync what = forward_sync(!buffers.empty());
  if (what == ForwardSync::kState) {
    SMP_CHECK(sliced.empty() || sliced.size() == params.size(),
              "ReplicaStep::sync_before_forward: ", sliced.size(), " slice marks for ",
              params.size(), " parameters");
    const bool split = !sliced.empty() && slice_group && slice_group->getSize() < I.pg->getSize();
    std::vector<at::Tensor> all, slices;
    for (size_t i = 0; i < params.size(); ++i)
      (split && sliced[i] ? slices : all).push_back(params[i]);
    all.insert(all.end(), buffers.begin(), buffers.end());
    broadcast_coalesced(I.pg, all, 0, kDefaultBucketBytesCap, I.opts.timeout_s);
    // Every rank of the dp group knows the same marks, so all take this branch alike.
    if (split) broadcast_coalesced(slice_group, slices, 0, kDefaultBucketBytesCap, I.opts.timeout_s);
    I.state_synced = true;
  } else if (what == ForwardSync::kBuffers) {
    broadcast_coalesced(I.pg, buffers, 0, kDefaultBucketBytesCap, I.opts.timeout_s);
  }
  return what;
}

int64_t ReplicaStep::steps() const { return impl_->steps; }

bool ReplicaStep::next_step_syncs() const {
  return (impl_->steps + 1) % impl_->opts.backward_passes_per_step == 0;
}

bool ReplicaStep::begin_step() {
  auto& I = *impl_;
  I.sync_step = next_step_syncs();
  ++I.steps;
  I.sync_backward = false;
  I.armed = false;
  return I.sync_step;
}

void ReplicaStep::set_sync_step(bool sync) { impl_->sync_step = sync; }
bool ReplicaStep::sync_step() const { return impl_->sync_step; }

void ReplicaStep::begin_microbatch(bool last) {
  impl_->sync_backward = impl_->sync_step && last;
}

void ReplicaStep::prepare_for_backward(Reducer& reducer, const std::vector<at::Tensor>& outputs) {
  auto& I = *impl_;
  reducer.prepare_for_backward(I.sync_backward, 1.0, outputs);
  I.armed |= I.sync_backward;
}

bool ReplicaStep::armed() const { return impl_->armed; }

ReducerStats ReplicaStep::end_step(Reducer* reducer) {
  if (!impl_->armed) return ReducerStats{};
  SMP_CHECK(reducer != nullptr, "ReplicaStep::end_step: the step was armed but no reducer given");
  return reducer->finalize();
}

void ReplicaStep::set_failure_post(StorePtr store, std::string prefix, int rank, int dp_rank) {
  auto& I = *impl_;
  I.store = std::move(store);
  I.prefix = std::move(prefix);
  I.rank = rank;
  I.dp_rank = dp_rank;
}

StepFailure ReplicaStep::fail_step(Reducer* reducer, bool sync_step, bool armed,
                                   const std::string& error) {
  auto& I = *impl_;
  if (!I.opts.reduces) return StepFailure::kNothing;
  if (!sync_step) {
    // Note [Failed peer]: a step that does not reduce has no collectives to tell the
    // peers in; this replica will not reach the next reduction, so it posts that.
    const int64_t step = reducer != nullptr ? reducer->steps_run() + 1 : 1;
    if (I.store) {
      try {
        post_failure(I.store, I.prefix, I.rank, step,
                     str_cat("dp rank ", I.dp_rank, " (rank ", I.rank,
                             ") failed a step that does not reduce and will not reach "
                             "reduction ", step, " (", error, ")"));
      } catch (const std::exception&) {  // the store is gone: the peers' own wait says more
      }
    }
    return StepFailure::kPosted;
  }
  // No reducer yet: the first step's agreement fails every rank together.
  if (reducer == nullptr) return StepFailure::kNothing;
  if (armed) {
    reducer->abandon_step();  // Note [Failed rank]: the rest of the step, flagged
    return StepFailure::kAbandoned;
  }
  reducer->fail_step();  // Note [Failed rank]: a flagged shadow step
  return StepFailure::kFailed;
}

const ReplicaStepOptions& ReplicaStep::options() const { return impl_->opts; }

}  // namespace smp
