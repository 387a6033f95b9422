// The reducer's default hooks: a sum through the process group, or, when every rank of
// the group runs on this host, a sum in the shared-memory arena (Note [Shared-memory
// bucket reduction], detail/shm_allreduce.cpp). The reducer installs one of them until
// a comm hook is registered (Reducer::Impl::build_buckets).
#include <ATen/ATen.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "smp_core/detail/reducer_impl.h"

namespace smp::detail {
namespace {

// The default hook: sums the buffer; the 1/world_size factor is fused into the copy
// of each gradient into the bucket (one pass over the gradient instead of two).
class SumAllreduceHook : public CommHook {
 public:
  FuturePtr run(GradBucket& bucket) override {
    return allreduce_flat(bucket.process_group(), bucket.buffer());
  }
  std::string name() const override { return "allreduce"; }
  bool issues_all_in_run() const override { return true; }
};

// The default hook when the ranks share this host: see Note [Shared-memory bucket
// reduction] (detail/shm_allreduce.cpp). Synchronous: the sum is done when run() returns.
class ShmSumHook : public CommHook {
 public:
  ShmSumHook(std::shared_ptr<ShmArena> arena, std::vector<size_t> offsets,
             double timeout_s, std::string group, std::shared_ptr<std::atomic<int64_t>> steps)
      : arena_(std::move(arena)), offsets_(std::move(offsets)), timeout_s_(timeout_s),
        group_(std::move(group)), steps_(std::move(steps)) {}
  FuturePtr run(GradBucket& bucket) override {
    const at::Tensor& buf = bucket.buffer();
    arena_->allreduce(offsets_.at(bucket.index()), buf.numel(), buf.scalar_type(),
                      bucket.is_shadow(), timeout_s_,
                      str_cat("bucket ", bucket.index(), " of ", bucket.bucket_count(),
                              " (shared memory) on ", group_, " in step ",
                              steps_->load() + 1));
    return completed_future(buf);
  }
  std::string name() const override { return "allreduce (shared memory)"; }
  bool issues_all_in_run() const override { return true; }

 private:
  std::shared_ptr<ShmArena> arena_;
  std::vector<size_t> offsets_;  // per bucket, bytes into this rank's slot
  double timeout_s_;
  std::string group_;
  std::shared_ptr<std::atomic<int64_t>> steps_;  // the reducer's steps_run
};

// Note [Reduce to owner]
// ~~~~~~~~~~~~~~~~~~~~~~
// With optimizer-state sharding (python/smp/optimizer_sharding.py) only one rank of
// the dp group steps each parameter, so only that rank needs its reduced gradient.
// The reducer then lays each bucket out owner by owner (a segment per owner, in rank
// order) and sums each segment to its owner alone: a reduce-scatter with the owners'
// (uneven) shares. In shared memory each owner sums its own segments from every slot
// (one round, like the allreduce); through the process group each segment is one
// reduce to its owner. Parameters every rank keeps (owner -1: tied weights, summed
// across pp ranks after the step) form a last segment that is all-reduced. finalize()
// writes back only what this rank keeps and leaves .grad None elsewhere, so between
// the reduction and the next backward a rank holds only its share of the gradients.
// The sum order per element is the allreduce's: the summing rank's value, then the
// others by rank.
class OwnerReduceHook : public CommHook {
 public:
  OwnerReduceHook(std::shared_ptr<ShmArena> arena, std::vector<size_t> offsets,
                  BucketSegments segments, double timeout_s, std::string group,
                  std::shared_ptr<std::atomic<int64_t>> steps)
      : arena_(std::move(arena)), offsets_(std::move(offsets)), segments_(std::move(segments)),
        timeout_s_(timeout_s), group_(std::move(group)), steps_(std::move(steps)) {}
  FuturePtr run(GradBucket& bucket) override {
    const at::Tensor& buf = bucket.buffer();
    const auto& segs = segments_.at(bucket.index());
    const std::string what =
        str_cat("bucket ", bucket.index(), " of ", bucket.bucket_count(), " (", name(), ") on ",
                group_, " in step ", steps_->load() + 1);
    if (arena_) {
      arena_->reduce_segments(offsets_.at(bucket.index()), segs, buf.scalar_type(),
                              bucket.is_shadow(), timeout_s_, what);
      return completed_future(buf);
    }
    const auto& pg = bucket.process_group();
    for (const Segment& seg : segs) {
      if (seg.begin >= seg.end) continue;
      std::vector<at::Tensor> v{buf.narrow(0, seg.begin, seg.end - seg.begin)};
      if (seg.owner < 0) {
        wait_work(pg->allreduce(v), timeout_s_, what);
      } else {
        c10d::ReduceOptions o;
        o.rootRank = seg.owner;
        wait_work(pg->reduce(v, o), timeout_s_, what);
      }
    }
    return completed_future(buf);
  }
  std::string name() const override {
    return arena_ ? "reduce to owner (shared memory)" : "reduce to owner";
  }
  bool issues_all_in_run() const override { return true; }

 private:
  std::shared_ptr<ShmArena> arena_;
  std::vector<size_t> offsets_;
  BucketSegments segments_;
  double timeout_s_;
  std::string group_;
  std::shared_ptr<std::atomic<int64_t>> steps_;
};

// Note [Slices reduce over their rdp group] (detail/reducer_build.cpp): the default
// hook of a reducer with tp slices. Replicated buckets go to `replicated_` (the shared
// memory or the dp group's allreduce, or their reductions to owners); a slice bucket
// is summed over its own group, the rdp group its GradBucket carries, never in the
// arena (which spans the dp group): by `sliced_` (with optimizer-state sharding, the
// reduction to its owners, rdp ranks, through the process group) or an allreduce.
class SliceRoutedHook : public CommHook {
 public:
  SliceRoutedHook(CommHookPtr replicated, CommHookPtr sliced, std::vector<char> sliced_bucket)
      : replicated_(std::move(replicated)), sliced_(std::move(sliced)),
        sliced_bucket_(std::move(sliced_bucket)) {}
  FuturePtr run(GradBucket& bucket) override {
    if (sliced_bucket_.at(bucket.index()))
      return sliced_ ? sliced_->run(bucket)
                     : allreduce_flat(bucket.process_group(), bucket.buffer());
    return replicated_->run(bucket);
  }
  at::Tensor result(GradBucket& bucket, const c10::IValue& value) override {
    if (sliced_bucket_.at(bucket.index()))
      return sliced_ ? sliced_->result(bucket, value) : CommHook::result(bucket, value);
    return replicated_->result(bucket, value);
  }
  std::string name() const override { return replicated_->name(); }
  bool issues_all_in_run() const override { return replicated_->issues_all_in_run(); }

 private:
  CommHookPtr replicated_;
  CommHookPtr sliced_;  // null: allreduce over the slice group
  std::vector<char> sliced_bucket_;  // per bucket index
};

}  // namespace

CommHookPtr make_slice_routed_hook(CommHookPtr replicated, CommHookPtr sliced,
                                   std::vector<char> sliced_bucket) {
  return std::make_shared<SliceRoutedHook>(std::move(replicated), std::move(sliced),
                                           std::move(sliced_bucket));
}

CommHookPtr make_owner_reduce_hook(std::shared_ptr<ShmArena> arena, std::vector<size_t> offsets,
                                   BucketSegments segments, double timeout_s, std::string group,
                                   std::shared_ptr<std::atomic<int64_t>> steps) {
  return std::make_shared<OwnerReduceHook>(std::move(arena), std::move(offsets),
                                           std::move(segments), timeout_s, std::move(group),
                                           std::move(steps));
}

CommHookPtr make_sum_allreduce_hook() { return std::make_shared<SumAllreduceHook>(); }

CommHookPtr make_shm_sum_hook(std::shared_ptr<ShmArena> arena, std::vector<size_t> offsets,
                              double timeout_s, std::string group,
                              std::shared_ptr<std::atomic<int64_t>> steps) {
  return std::make_shared<ShmSumHook>(std::move(arena), std::move(offsets), timeout_s,
                                      std::move(group), std::move(steps));
}

}  // namespace smp::detail
