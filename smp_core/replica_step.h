// smp::ReplicaStep: the data-parallel step policy of one replica of a dp group, the
// one place that decides it for both front ends: smp.DistributedModel in Python
// (python/smp/replica.py and model.py, through smp._C.ReplicaStep) and
// smp::DistributedModel for libtorch programs (distributed_model.cpp).
//
// It decides, for this replica:
// - before a forward: the first broadcasts parameters and buffers from dp rank 0, a
//   later one the buffers only, when broadcast_buffers is on and there are buffers
//   (sync_before_forward; forward_sync says which without doing it);
// - whether a step synchronizes: every backward_passes_per_step-th (no_sync steps only
//   accumulate; the next synchronized one reduces the sum), unless the caller decides
//   otherwise (Join's announce; smp::DistributedModel::backward's `sync`);
// - arming the reducer: prepare_for_backward(sync) with sync only on the step's last
//   microbatch of a synchronized step, and finalize() after the step only if armed;
// - what a failed step does (fail_step): nothing when the replica does not reduce;
//   posts the failure when the step does not synchronize (Note [Failed peer] in
//   reducer.cpp); abandon_step() once armed; else the reducer's fail_step() (Note
//   [Failed rank] in detail/reducer_shadow.cpp).
//
// Where the two front ends legitimately differ, the difference stays with them:
// - The bucket order. Python records the order in which modules first use their
//   parameters with forward pre-hooks during the first microbatch and makes the
//   reducer at the first reducing step with dp rank 0's order (Note [Bucket order from
//   the first iteration] in python/smp/replica.py); libtorch modules have no hooks, so
//   smp::DistributedModel makes its reducer at construction in registration order and
//   relies on the reducer's rebuild after the first step.
// - Join (python/smp/join.py) broadcasts the buffers from the last active rank instead
//   of dp rank 0 (join_sync_buffers): Python asks forward_sync() and runs Join's
//   broadcast itself. smp::DistributedModel has no Join.
// - Failures. smp::DistributedModel's backward() calls fail_step when autograd throws,
//   then rethrows: a synchronized step's peers raise naming this rank. It sets no
//   failure post, so a failed step that does not synchronize tells nobody (its peers'
//   next reduction times out, naming what it awaited); Python posts it.
// - Which replicas reduce: Python's `reduces` is config 'ddp' and more than one replica;
//   smp::DistributedModel always reduces (a reducer even on a group of one).
//
// Collective: every replica of the group calls sync_before_forward, and runs its
// reducer's steps, at the same points. Not thread-safe: one training thread. Holds no
// reducer: the caller passes its own to each call that drives one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/comm.h"
#include "smp_core/reducer.h"

namespace smp {

struct ReplicaStepOptions {
  // Whether this replica reduces gradients at all; false: every decision is "nothing".
  bool reduces = true;
  // Broadcast buffers from dp rank 0 before every forward after the first.
  bool broadcast_buffers = true;
  // Steps whose gradients accumulate before one reduction (no_sync); >= 1.
  int64_t backward_passes_per_step = 1;
  // Seconds a broadcast may take.
  double timeout_s = 300.0;
};

// What a forward's synchronization broadcasts from dp rank 0.
enum class ForwardSync { kNothing, kBuffers, kState };

// What a failed step did (fail_step).
enum class StepFailure { kNothing, kPosted, kAbandoned, kFailed };

class ReplicaStep {
 public:
  // Throws ConfigError unless backward_passes_per_step >= 1.
  ReplicaStep(ProcessGroupPtr dp, ReplicaStepOptions options = {});
  ~ReplicaStep();
  ReplicaStep(const ReplicaStep&) = delete;
  ReplicaStep& operator=(const ReplicaStep&) = delete;

  // --- before a forward ---------------------------------------------------------------

  // What the next sync_before_forward broadcasts (kState until the first has run).
  ForwardSync forward_sync(bool has_buffers) const;
  // Broadcasts from dp rank 0 what forward_sync says: `params` and `buffers` the first
  // time, `buffers` later. Returns what it broadcast. Tensor parallelism: a parameter
  // with `sliced[i]` set is a tp slice (Note [Slices reduce over their rdp group] in
  // detail/reducer_build.cpp), which only the ranks of `slice_group` (the rdp group)
  // hold alike: it is broadcast from that group's rank 0 instead (empty / null: none).
  ForwardSync sync_before_forward(const std::vector<at::Tensor>& params,
                                  const std::vector<at::Tensor>& buffers,
                                  const std::vector<int>& sliced = {},
                                  const ProcessGroupPtr& slice_group = nullptr);

  // --- the step -----------------------------------------------------------------------

  // Steps begun so far.
  int64_t steps() const;
  // Whether the next step synchronizes by the count (every backward_passes_per_step-th).
  bool next_step_syncs() const;
  // Starts a step: counts it, disarms, and returns whether it synchronizes by the count.
  bool begin_step();
  // The caller decided otherwise for this step (Join's announce; an explicit sync).
  void set_sync_step(bool sync);
  bool sync_step() const;
  // Before each microbatch: only the last of a synchronized step reduces.
  void begin_microbatch(bool last);
  // Before a backward of the current microbatch: reducer.prepare_for_backward with this
  // microbatch's sync; a synchronized one arms the step.
  void prepare_for_backward(Reducer& reducer, const std::vector<at::Tensor>& outputs);
  // Whether this step armed the reducer (a synchronized backward began).
  bool armed() const;
  // After the step's body: reducer->finalize() if armed; returns its stats, else zeros.
  ReducerStats end_step(Reducer* reducer);

  // --- a failed step ------------------------------------------------------------------

  // Note [Failed peer]: where fail_step posts a failure of a step that does not
  // synchronize (store keys <prefix>/<rank>/<step>); `rank` and `dp_rank` name this
  // rank in the message. Without it such a failure posts nothing.
  void set_failure_post(StorePtr store, std::string prefix, int rank, int dp_rank);
  // This rank's step failed (`sync_step`: whether it synchronizes; `armed`: whether
  // the reducer was armed). `error` ("Type: first line") goes into a posted message.
  // `reducer` may be null (not made yet). Never throws from posting.
  StepFailure fail_step(Reducer* reducer, bool sync_step, bool armed, const std::string& error);

  const ReplicaStepOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace smp
