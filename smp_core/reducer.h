// Reducer: averages the gradients of one replica-local model part across a data-
// parallel process group in buckets, overlapping communication with backward, like
// torch DDP's reducer (which Debian's torch does not ship in usable form). See
// docs/reducer.md for the full contract.
//
// One step, on every rank of the group, from one thread:
//   prepare_for_backward(sync=false, ...) ; backward   (zero or more: grads accumulate)
//   prepare_for_backward(sync=true, ...)  ; backward   (the last backward of the step)
//   finalize()                                        (waits; writes .grad)
// During a synchronized backward each gradient is scaled into its bucket when its
// grad accumulator fires; a bucket is launched (handed to the comm hook on the comm
// thread) once all its gradients are ready and every lower-indexed bucket was launched.
//
// Threads: prepare_for_backward/finalize/run_shadow_step from the training thread;
// the grad-accumulator hooks run on autograd's thread; hooks run on the reducer's comm
// thread (see Note [Ordered bucket communication] in comm_queue.h). When all ranks
// share this host the buckets live in shared memory and the default path sums them
// there (Note [Shared-memory bucket reduction]). A caller holding
// Python's GIL must release it around finalize() and run_shadow_step(), because a
// Python comm hook needs it on the comm thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/comm.h"
#include "smp_core/grad_bucket.h"

namespace smp {

// Bytes per bucket unless configured; torch DDP's default.
constexpr size_t kDefaultBucketBytesCap = size_t{25} << 20;
// Bytes of the first bucket of each dtype/device: small, so the first communication
// starts early in backward (torch DDP's _DEFAULT_FIRST_BUCKET_BYTES).
constexpr size_t kDefaultFirstBucketBytes = size_t{1} << 20;

struct ReducerOptions {
  // Bytes per gradient bucket; smaller overlaps more, costs more calls. A bucket is
  // closed once it holds at least the cap, so its last tensor may overflow it (as in
  // torch DDP); a tensor larger than the cap gets a bucket of its own.
  size_t bucket_cap_bytes = kDefaultBucketBytesCap;
  // Cap of the first bucket of each dtype/device (min with bucket_cap_bytes).
  size_t first_bucket_bytes = kDefaultFirstBucketBytes;
  // Make each param.grad a view of its bucket slice: no copy in or out.
  bool gradient_as_bucket_view = false;
  // Launch buckets during backward; false: launch them all in finalize().
  bool overlapping = true;
  // Parameter indices in the order their gradients are expected to become ready
  // (a permutation of 0..n-1); empty: reverse registration order.
  std::vector<int64_t> expected_order;
  // Seconds any wait may take (hook futures, finalize).
  double timeout_s = 300.0;
  // Keep the buckets in a shared-memory segment and sum them there when every rank of
  // the group runs on this host and no comm hook is registered (CPU tensors only);
  // else the process group reduces them. SMP_REDUCER_SHM=0 turns it off.
  bool shared_memory = true;
  // Rebuild the buckets once, after the first synchronized step, in the order
  // gradients actually became ready on dp rank 0, if that changes them.
  bool rebuild_buckets = true;
  // Names the group in errors ("dp").
  std::string group_name = "dp";
  // Optimizer-state sharding (Note [Reduce to owner], detail/reducer_default_hooks.cpp):
  // owners[i] is the group rank that keeps parameter i's reduced gradient (for a tp
  // slice, below: a rank of slice_group), or -1 for every rank. Each bucket is laid out
  // owner by owner and each owner's part is summed to that rank only (a reduce-scatter,
  // a slice bucket's over slice_group); finalize() leaves .grad None on the others.
  // No comm hook can be registered. Empty: every rank keeps every gradient.
  std::vector<int> owners;
  // Tensor parallelism (Note [Slices reduce over their rdp group],
  // detail/reducer_build.cpp): sliced[i] != 0 marks parameter i as a tp slice, summed
  // over `slice_group` (the rdp group, a subgroup of the reducer's group holding this
  // rank's tp rank) instead of the whole group, and divided by the group's size or,
  // with `prescaled_batch` (the tp ranks read the same batch), by slice_group's size.
  // Empty (or a slice_group as large as the group, tp = 1): every parameter is
  // replicated. No comm hook with slices (ConfigError, check_slices).
  std::vector<int> sliced;
  ProcessGroupPtr slice_group;
  bool prescaled_batch = false;
};

// What the last finalize() saw. Times in milliseconds.
struct ReducerStats {
  int64_t steps = 0;            // synchronized steps finalized so far
  int64_t buckets = 0;          // buckets of the last step
  double copy_in_ms = 0;        // scaling grads into buckets (autograd thread)
  double comm_ms = 0;           // comm thread: hooks until their futures completed
  double wait_ms = 0;           // finalize() blocked on communication
  double write_back_ms = 0;     // results into .grad
  int64_t unused_local = 0;     // params without a gradient on this rank
  int64_t unused_global = 0;    // params without a gradient on every rank
  bool rebuilt = false;         // the buckets were rebuilt at the end of this step
  bool redone = false;          // pipeline step reduced twice (a late gradient somewhere)
  int64_t early_buckets = 0;    // buckets launched before finalize() (overlapped backward)
  double first_launch_s = 0;    // steady clock (s) of the step's first launch; 0: none
};

class Reducer {
 public:
  // `params`: leaf tensors requiring grad, all distinct. Verifies across `pg` (an
  // allgather: every member must construct its Reducer at the same point) that every
  // rank holds the same count, shapes and dtypes and the same options; a mismatch
  // throws CommError on every rank, naming the first differing parameter and ranks.
  Reducer(std::vector<at::Tensor> params, ProcessGroupPtr pg, ReducerOptions options = {});
  // Removes the autograd hooks; pending communication is dropped.
  ~Reducer();

  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Replaces the default (average by allreduce) with `hook`. Allowed once, before the
  // first prepare_for_backward; else throws std::logic_error
  // "smp: register_comm_hook must be called once, before the first step". Throws
  // ConfigError with ReducerOptions::owners (a hook reduces whole buckets).
  void register_comm_hook(CommHookPtr hook);

  // Before the first step: lays the buckets out as torch's DistributedDataParallel
  // constructor does (each bucket in parameter registration order, the buckets from
  // the last parameters to the first), if that holds the same buckets as the current
  // layout in another order (else keeps it); the rebuild after the first step then
  // orders them by gradient arrival, as torch's does. Collective over the group (every rank
  // calls it at the same point). Throws std::logic_error after the first step.
  // See Note [Hook buckets follow torch's] in detail/reducer_rebuild.cpp.
  void use_torch_initial_layout();

  // Before the first step: takes `layout` (parameter indices per bucket, as
  // bucket_indices() returned at a checkpoint) as the buckets, and no rebuild follows:
  // a resumed job then shows its comm hook the buckets it showed before the restart
  // (Note [Automatic resume] in python/smp/auto_resume.py). Collective over the group,
  // every rank with its own saved layout. Throws std::invalid_argument unless `layout`
  // holds every parameter exactly once; std::logic_error after the first step.
  void adopt_layout(std::vector<std::vector<int64_t>> layout);

  // Call before each backward. sync=false: gradients only accumulate in .grad.
  // sync=true: this backward is the step's last; gradients are scaled by
  // `grad_scale` into the buckets as they become ready. Parameters not reachable from
  // `outputs`' autograd graph are ready at once with their current .grad (or zeros);
  // empty `outputs` means every gradient is already final (backward has run).
  void prepare_for_backward(bool sync, double grad_scale = 1.0,
                            const std::vector<at::Tensor>& outputs = {});

  // Pipeline parallelism (partitions > 1), instead of prepare_for_backward(true, ...):
  // call once in a synchronized step, before this rank's first backward work of it,
  // then finalize() after the step. From the second such step on, a parameter is ready
  // when its grad accumulator has fired as often as in the step before (after its last
  // microbatch's backward), so its bucket launches during the rest of the pipeline's
  // backward. `hold`: parameter indices ready only in finalize() (tied weights summed
  // across pp ranks after the step). See Note [Pipeline overlap] in
  // detail/reducer_pipeline.cpp.
  void prepare_for_pipeline_backward(double grad_scale, const std::vector<int64_t>& hold = {});

  // After the step's last backward: launches what is left, waits for every bucket,
  // writes each parameter's .grad and reduces which parameters were used: one unused
  // on every rank keeps its .grad (None stays None); one used on some rank gets the
  // reduced gradient (ranks without it contributed zeros). Throws CommError /
  // TimeoutError naming the bucket and group; after a failure the reducer is unusable.
  ReducerStats finalize();

  // Join: this rank has no data this step. Issues the same collectives as a real step
  // (every bucket through the hook with zero buffers, the bitmap, the first step's
  // rebuild broadcast); leaves .grad untouched.
  void run_shadow_step();

  // This rank cannot run its step (a bad input, an exception before backward): it
  // issues the step's collectives as a shadow step, flagged, so that every other rank
  // of the group raises CommError in finalize() naming this rank, instead of waiting
  // for it until the timeout. Call where the step's reduction would have been.
  void fail_step();

  // The step failed after the reducer was armed (prepare_for_backward(sync=true) or
  // prepare_for_pipeline_backward): an exception during or after backward. Launches
  // what is left of the step's collectives, with this rank's failed slot set, and waits
  // for them, so that every other rank raises CommError in finalize() naming this rank
  // instead of waiting for it until the timeout (Note [Failed rank]). Before arming it
  // is fail_step(). The reducer is unusable afterwards; never throws (the caller raises
  // its own error).
  void abandon_step();

  // Note [Failed peer] (reducer.cpp): `probe(step)` is asked, from the waiting thread,
  // each second that a wait of step `step`'s reduction lasts; a non-empty answer (why a
  // peer will not come) ends the wait with that CommError. Call before the first step.
  void set_peer_probe(std::function<std::string(int64_t step)> probe);

  // Join with divide_by_initial_world_size=False: the default hook divides the next
  // synchronized steps' gradients by `n` (the ranks still training) instead of the
  // group size; 0 restores the group size. Custom hooks divide as they choose (as in
  // torch DDP). Call from the training thread between steps.
  void set_active_ranks(int n);
  // Synchronized steps so far, shadow steps included (errors name step steps_run()+1).
  int64_t steps_run() const;

  // Parameter indices per bucket, in launch order.
  std::vector<std::vector<int64_t>> bucket_indices() const;
  // Whether the buckets were rebuilt from the observed gradient order.
  bool rebuilt() const;
  // Whether the buckets live in a shared-memory segment (ReducerOptions::shared_memory
  // and every rank on this host); the default hook then sums them there.
  bool shared_memory() const;
  // Note [Hierarchical reduction] (detail/host_links.cpp): one line describing the
  // reduction between hosts, or "" when it is flat.
  std::string hierarchy() const;
  // The group of the hosts' first ranks, over which a registered hook runs (Note [Hooks
  // between hosts]); null when flat, and on the other ranks of a host.
  ProcessGroupPtr hosts_group() const;
  ReducerStats stats() const;
  // Whether some parameters are tp slices reduced over the slice group (above).
  bool sliced() const;
  // Throws ConfigError naming both settings where tp slices (`sliced`) meet what cannot
  // reduce them yet: a comm hook (`hook`: its name, "" for none). The reducer checks it
  // itself; smp.DistributedModel also calls it in register_comm_hook, where every rank
  // of every stage does.
  static void check_slices(bool sliced, const std::string& hook);
  size_t num_params() const;
  const ProcessGroupPtr& process_group() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// Splits `params` (indices into `tensors`, in `order`) into buckets: one running
// bucket per (group, dtype, device); a bucket closes once it holds >= its cap (the
// first of each key: min(first_bucket_bytes, bucket_cap_bytes)). Buckets are sorted by
// the position of their first tensor in `order`. `groups[i]`: the process group that
// reduces tensor i (0 or 1, Note [Slices reduce over their rdp group]); empty: all 0.
std::vector<std::vector<int64_t>> compute_bucket_assignment(
    const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& order,
    size_t bucket_cap_bytes, size_t first_bucket_bytes, const std::vector<int>& groups = {});

// Broadcasts `tensors` in place from group rank `root`: flattened per dtype/device
// into chunks of at most `bucket_bytes` (a larger tensor alone), one broadcast each.
// Every member calls it with tensors of the same shapes, at the same point.
void broadcast_coalesced(const ProcessGroupPtr& pg, const std::vector<at::Tensor>& tensors,
                         int root, size_t bucket_bytes = kDefaultBucketBytesCap,
                         double timeout_s = 300.0);

// Broadcasts of tensor lists from their roots, issued without waiting so that they
// run while the caller goes on (optimizer-state sharding: each rank's stepped share of
// the parameters, round by round while the next round is stepped; Note [Sharded
// optimizer state] in python/smp/optimizer_sharding.py). Every member issues the same
// start() calls in the same order, with tensors of the same shapes. Each start()
// chunks its tensors as broadcast_coalesced does; a chunk of one contiguous tensor is
// broadcast in place, others through a flat copy written back by wait(). Not
// thread-safe; the destructor waits for what is still in flight.
class ShareExchange {
 public:
  ShareExchange(ProcessGroupPtr pg, size_t bucket_bytes = kDefaultBucketBytesCap,
                double timeout_s = 300.0);
  ~ShareExchange();
  ShareExchange(const ShareExchange&) = delete;
  ShareExchange& operator=(const ShareExchange&) = delete;

  // Issues the broadcasts of `tensors` from group rank `root` into the current round.
  void start(const std::vector<at::Tensor>& tensors, int root);
  // Starts a new round.
  void end_round();
  // Waits for the oldest rounds until at most `leave` are in flight, writing each
  // received chunk into its tensors. Throws TimeoutError / CommError naming the
  // broadcast.
  void wait(size_t leave = 0);

 private:
  struct Pending;
  ProcessGroupPtr pg_;
  size_t bucket_bytes_;
  double timeout_s_;
  std::deque<std::vector<Pending>> rounds_;
};

}  // namespace smp
