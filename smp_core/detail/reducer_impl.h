// Reducer::Impl and what the reducer's sources share. Included only from
// smp_core/reducer.cpp (bucket arming, the normal step) and
// smp_core/detail/reducer_*.cpp: build (construction: checks, buckets, autograd hooks),
// default_hooks (the default allreduce hooks), rebuild
// (Note [Bucket rebuild]), shadow (join's shadow step), pipeline (Note [Pipeline
// overlap]).
//
// Threads (see reducer.h): every member is guarded by `mu` unless it says otherwise;
// functions named *_locked expect the caller to hold it.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "smp_core/comm_queue.h"
#include "smp_core/compat/torch_compat.h"
#include "smp_core/detail/shm_allreduce.h"
#include "smp_core/detail/used_bitmap.h"
#include "smp_core/errors.h"
#include "smp_core/grad_bucket.h"
#include "smp_core/reducer.h"

namespace smp {
namespace detail {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

inline size_t align64(size_t n) { return (n + 63) / 64 * 64; }

// "Float[3, 4]", with "@cuda:0" off the CPU: a tensor as errors name it.
std::string describe_tensor(const at::Tensor& t);

// True if `grad` is exactly `view` (same memory, shape and strides).
bool is_view_of(const at::Tensor& grad, const at::Tensor& view);

// The default hooks (detail/reducer_default_hooks.cpp): sum through the process group,
// or, when the ranks share this host, in the shared-memory arena. Both sum only: the
// 1/world_size factor is fused into the copy of each gradient into its bucket.
CommHookPtr make_sum_allreduce_hook();
// `offsets`: per bucket, bytes into this rank's arena slot; `steps`: the reducer's
// steps_done, for errors naming the step.
CommHookPtr make_shm_sum_hook(std::shared_ptr<ShmArena> arena, std::vector<size_t> offsets,
                              double timeout_s, std::string group,
                              std::shared_ptr<std::atomic<int64_t>> steps);
// Note [Reduce to owner]: the default hooks with ReducerOptions::owners, summing each
// of bucket b's `segments[b]` to its owner only. `arena` null: through the process group.
using BucketSegments = std::vector<std::vector<Segment>>;
CommHookPtr make_owner_reduce_hook(std::shared_ptr<ShmArena> arena, std::vector<size_t> offsets,
                                   BucketSegments segments, double timeout_s,
                                   std::string group,
                                   std::shared_ptr<std::atomic<int64_t>> steps);
// Note [Slices reduce over their rdp group]: `replicated` for the buckets of the
// reducer's group; a bucket with `sliced_bucket[index]` set goes to `sliced` instead
// (with owners: the reduction to owners over the slice group), or, when that is null,
// is summed by allreduce over its own (slice) group.
CommHookPtr make_slice_routed_hook(CommHookPtr replicated, CommHookPtr sliced,
                                   std::vector<char> sliced_bucket);

// Note [Hierarchical reduction] (detail/host_links.cpp): the links between the hosts
// of `pg` (collective over it; null on every rank when the group stays flat).
std::shared_ptr<const HostLinks> make_host_links(const ProcessGroupPtr& pg, bool allowed,
                                                 double timeout_s, const std::string& what);
// Note [Hooks between hosts]: runs `inner` on the hosts' means over the hosts group.
CommHookPtr make_hosts_hook(CommHookPtr inner, std::shared_ptr<ShmArena> arena, double timeout_s,
                            std::string group, std::shared_ptr<std::atomic<int64_t>> steps);

struct ReducerBucket {
  at::Tensor buffer;               // flat, contiguous
  std::vector<int64_t> params;     // parameter indices, in buffer order
  std::vector<at::Tensor> tensors; // the parameters themselves (for GradBucket)
  std::vector<int64_t> offsets;
  std::vector<at::Tensor> views;   // views[j]: buffer slice shaped like params[j]
  std::vector<Segment> segments;   // owner by owner (Note [Reduce to owner]); or empty
  int group = 0;                   // 1: tp slices, over the slice group (Note [Slices...])
  size_t pending = 0;              // gradients not yet ready this step
};

// One bucket's communication in one step; shared with its comm-thread task.
struct BucketRun {
  std::shared_ptr<GradBucket> bucket;
  FuturePtr future;  // the hook's
  at::Tensor result;  // set once the future completed and the hook's result() ran
  Clock::time_point start;
  std::shared_ptr<std::atomic<int64_t>> done_ns = std::make_shared<std::atomic<int64_t>>(0);
  double comm_ms() const {
    int64_t d = done_ns->load();
    auto end = d ? Clock::time_point(Clock::duration(d)) : Clock::now();
    return std::chrono::duration<double, std::milli>(end - start).count();
  }
};

}  // namespace detail

struct Reducer::Impl : std::enable_shared_from_this<Reducer::Impl> {
  using Clock = detail::Clock;
  using Bucket = detail::ReducerBucket;
  enum class Phase { kIdle, kAccumulate, kSync };

  std::vector<at::Tensor> params;
  ProcessGroupPtr pg;
  ReducerOptions opts;
  int rank = 0, world = 1;
  std::string group;  // "the dp process group (gloo, rank 0 of 2)"
  // Note [Slices reduce over their rdp group] (detail/reducer_build.cpp): set by init()
  // when some parameters are tp slices; `groups[i]` is 1 for those, 0 for the others
  // (empty when none is).
  ProcessGroupPtr slice_pg;
  int slice_world = 1;
  int slice_rank = 0;  // this rank's rank in the slice group
  std::string slice_group;  // "the rdp process group (gloo, rank 0 of 2)"
  std::vector<int> groups;
  bool slicing() const { return !groups.empty(); }

  std::vector<compat::GradAccumulatorPtr> accumulators;  // kept alive
  std::vector<uintptr_t> hook_keys;
  std::unordered_map<const torch::autograd::Node*, int64_t> node_index;

  CommHookPtr hook = detail::make_sum_allreduce_hook();
  bool default_hook = true;
  CommHookPtr user_hook;  // the registered hook (`hook` wraps it between hosts)
  // Note [Hierarchical reduction]: set once by init() when the group spans hosts.
  std::shared_ptr<const detail::HostLinks> links;
  std::unique_ptr<CommQueue> queue;
  std::shared_ptr<detail::ShmArena> arena;  // null: reduce through the process group
  size_t bitmap_offset = 0;                 // of the bitmap in this rank's arena slot
  detail::UsedBitmap bitmap_slots;          // Note [Used bitmap]; set by init()

  mutable std::mutex mu;
  std::vector<std::vector<int64_t>> layout;
  std::vector<Bucket> buckets;
  std::vector<std::pair<int64_t, int64_t>> where;  // param -> (bucket, position)
  Phase phase = Phase::kIdle;
  bool started = false;
  std::string broken;  // first failure; the reducer refuses further steps
  // Note [Failed peer]: asked during a wait longer than kProbeEvery_s, with the step
  // being reduced; "" or why a peer will never reach it (set_peer_probe).
  std::function<std::string(int64_t)> peer_probe;
  static constexpr double kProbeEvery_s = 1.0;

  // The step in flight.
  // Per bucket group (0: replicated, 1: tp slices): wrapped-number scalars of the
  // copy-in factor.
  at::Tensor scale[2];
  double factor[2] = {1.0, 1.0};
  std::vector<char> ready, used;
  size_t next_launch = 0;
  bool tail_launched = false;
  std::vector<std::shared_ptr<detail::BucketRun>> runs;
  std::vector<CommQueue::TicketPtr> tickets;
  at::Tensor bitmap;  // int32, bitmap_slots.size() (Note [Used bitmap])
  CommQueue::TicketPtr bitmap_ticket;
  at::Tensor order;
  CommQueue::TicketPtr order_ticket;
  double copy_in_ms = 0;
  int64_t early_buckets = 0;
  double first_launch_s = 0;

  // Pipeline steps (Note [Pipeline overlap]).
  bool pipeline = false;                  // this sync step is a pipeline step
  bool finalizing = false;                // finalize() has begun (the tail may launch)
  bool abandoning = false;                // abandon_step(): the tail carries our failed slot
  std::vector<int64_t> fires;             // accumulator fires this step
  std::vector<int64_t> expected_fires;    // fires of the last pipeline step (empty: none)
  std::vector<char> hold;                 // ready only in finalize (tied weights)
  int64_t stale = 0;                      // fires after a parameter was copied out
  int active_ranks = 0;  // 0: divide by world (see set_active_ranks)
  // Synchronized + shadow steps finished or failed; shared with ShmSumHook's errors.
  std::shared_ptr<std::atomic<int64_t>> steps_done = std::make_shared<std::atomic<int64_t>>(0);

  // Gradient order of the first step (Note [Bucket rebuild]).
  bool recording = true;
  std::vector<char> seen;
  std::vector<int64_t> ready_order;
  bool rebuild_pending = true;
  bool rebuilt = false;
  ReducerStats stats;

  Impl(std::vector<at::Tensor> ps, ProcessGroupPtr g, ReducerOptions o)
      : params(std::move(ps)), pg(std::move(g)), opts(std::move(o)) {}

  // detail/reducer_build.cpp: construction.
  void init();
  // Note [Reduce to owner]: with owners, each bucket's parameters grouped by owner
  // (stable; owners in rank order, every-rank ones last); Note [Slices reduce over
  // their rdp group]: a bucket holding both groups (a saved layout) split in two, the
  // replicated part first; else `layout` itself.
  std::vector<std::vector<int64_t>> arranged(std::vector<std::vector<int64_t>> layout) const;
  bool sharded() const { return !opts.owners.empty(); }
  // Whether this rank keeps parameter i's reduced gradient (a tp slice's owner is a
  // rank of the slice group, Note [Slices reduce over their rdp group]).
  bool keeps(int64_t i) const {
    return !sharded() || opts.owners[i] < 0 ||
           opts.owners[i] == (slicing() && groups[i] ? slice_rank : rank);
  }
  void verify_across_ranks(const std::vector<int64_t>& order);
  // compute_bucket_assignment with this reducer's caps and groups, arranged().
  std::vector<std::vector<int64_t>> assign(const std::vector<int64_t>& order) const;
  void build_buckets(std::vector<std::vector<int64_t>> new_layout);
  void make_arena(const std::vector<std::vector<int64_t>>& for_layout);
  void wrap_user_hook();

  // reducer.cpp: bucket arming, the normal step.
  void on_grad_ready(int64_t i);
  void mark_ready_locked(int64_t i);
  void launch_ready_locked();
  void launch_locked(size_t b, bool shadow);
  // Queues the allreduce of `bitmap` as it is filled now (Note [Used bitmap]).
  CommQueue::TicketPtr submit_bitmap_locked(const std::string& what);
  void await_bucket(size_t b, const CommQueue::TicketPtr& ticket);
  void write_back(size_t b, const int32_t* global);
  void prepare(bool sync, double grad_scale, const std::vector<at::Tensor>& outputs,
               const std::vector<int64_t>* held = nullptr);
  ReducerStats finalize();
  void shutdown();

  // detail/reducer_rebuild.cpp (Note [Bucket rebuild]).
  void submit_order_locked();
  std::vector<int64_t> layout_order() const;
  bool apply_order();

  // detail/reducer_pipeline.cpp (Note [Pipeline overlap]).
  void prepare_pipeline(double grad_scale, const std::vector<int64_t>& held);
  // prepare()'s part for a pipeline step: the fire counts, `held`, and parameters
  // already final.
  void arm_pipeline_locked(const std::vector<int64_t>& held);
  // on_grad_ready()'s part in a pipeline step.
  void on_pipeline_fire_locked(int64_t i);
  // finalize()'s part in a pipeline step, with `lock` (on mu) released: waits for the
  // buckets and the bitmap, redoes every bucket if some rank saw a late fire, writes
  // back, and empties `waits`.
  void finalize_pipeline(std::unique_lock<std::mutex>& lock,
                         std::vector<CommQueue::TicketPtr>& waits,
                         const CommQueue::TicketPtr& bitmap_t, ReducerStats& st);
  void redo_all_locked();

  // detail/reducer_shadow.cpp: join's shadow step, and a failed step.
  void shadow_step(bool failed = false);
  void abandon_step();
  void redo_if_late(std::unique_lock<std::mutex>& lock);
  // queue->wait(t, timeout_s + 1), asking peer_probe between slices (Note [Failed peer]).
  void wait_ticket(const CommQueue::TicketPtr& t);

  // Throws CommError if the summed bitmap names a rank that failed its step (Note
  // [Failed rank] in detail/reducer_shadow.cpp).
  void check_failed_ranks() const;

  void check_usable() const {
    if (!broken.empty())
      throw CommError(str_cat("smp: the reducer of ", group,
                              " is unusable after an earlier failure: ", broken));
  }
  // A rank that ran out of data while its peers go on leaves them waiting, or exits
  // under them: a timeout of a step, or a peer that exited or closed its connections
  // in one, says what to do about uneven inputs.
  [[noreturn]] static void rethrow_with_hint(const std::exception& e);
  std::string bucket_what(size_t b) const {
    return str_cat("bucket ", b, " of ", buckets.size(), " (comm hook '", hook->name(),
                   "') on ", buckets[b].group ? slice_group : group, " in step ",
                   steps_done->load() + 1);
  }
};

}  // namespace smp
