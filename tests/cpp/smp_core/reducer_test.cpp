// Reducer, CommQueue, GradBucket and DistributedModel over real Gloo ranks (threads,
// tests/cpp/common/gloo_world.h). Closed-form answers: rank r's gradients are r+1, so
// the average is (n+1)/2.
#include "smp_core/reducer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <atomic>
#include <mutex>
#include <numeric>

#include "../common/gloo_world.h"
#include "smp_core/comm_queue.h"
#include "smp_core/detail/used_bitmap.h"
#include "smp_core/distributed_model.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using testing::run_gloo_world;
using Shapes = std::vector<std::vector<int64_t>>;

std::vector<at::Tensor> make_params(const Shapes& shapes, at::ScalarType dtype = at::kFloat) {
  std::vector<at::Tensor> ps;
  for (const auto& s : shapes) ps.push_back(torch::randn(s, at::TensorOptions(dtype)).requires_grad_());
  return ps;
}

// A loss whose gradient is `value` in every element of each parameter in `ps`.
at::Tensor linear_loss(const std::vector<at::Tensor>& ps, double value) {
  at::Tensor loss = torch::zeros({}, at::kDouble);
  for (const auto& p : ps) loss = loss + (p * value).sum().to(at::kDouble);
  return loss;
}

// One synchronized step: prepare, backward, finalize.
ReducerStats step(Reducer& red, const at::Tensor& loss, double scale = 1.0) {
  red.prepare_for_backward(true, scale, {loss});
  loss.backward();
  return red.finalize();
}

void expect_all(const at::Tensor& t, double v, double tol, const std::string& what) {
  ASSERT_TRUE(t.defined()) << what << ": no gradient";
  if (t.numel() == 0) return;
  double lo = t.min().item<double>(), hi = t.max().item<double>();
  EXPECT_NEAR(lo, v, tol) << what;
  EXPECT_NEAR(hi, v, tol) << what;
}

void zero_grads(const std::vector<at::Tensor>& ps, bool set_to_none) {
  for (auto p : ps) {
    if (set_to_none) {
      p.mutable_grad() = at::Tensor();
    } else if (p.grad().defined()) {
      p.mutable_grad().zero_();
    }
  }
}

// Records each bucket it sees, then averages it (divide, allreduce).
class RecordingHook : public CommHook {
 public:
  struct Call {
    size_t index, count;
    bool last;
    int64_t numel;
    std::vector<std::vector<int64_t>> grad_shapes, param_shapes;
    double sum;
  };
  FuturePtr run(GradBucket& b) override {
    Call c{b.index(), b.bucket_count(), b.is_last(), b.buffer().numel(), {}, {},
           b.buffer().to(at::kDouble).sum().item<double>()};
    for (auto& g : b.gradients()) c.grad_shapes.push_back(g.sizes().vec());
    for (auto& p : b.parameters()) c.param_shapes.push_back(p.sizes().vec());
    {
      std::lock_guard<std::mutex> lock(mu);
      calls.push_back(c);
    }
    at::Tensor buf = b.buffer();
    buf.div_(b.process_group()->getSize());
    std::vector<at::Tensor> v{buf};
    return b.process_group()->allreduce(v)->getFuture();
  }
  std::string name() const override { return "recording"; }
  std::mutex mu;
  std::vector<Call> calls;
};

// --- used bitmap (no processes) ----------------------------------------------------

// Each rank packs its slots; the allreduce is their element-wise sum. Rank r of 13 used
// parameter j iff (r + j) % 3 == 0, saw r late fires, and ranks 4 and 12 (beyond any
// bit budget of one int32) failed.
TEST(UsedBitmap, NamedSlotsSurviveTheSum) {
  const size_t n = 3;
  const int world = 13;
  detail::UsedBitmap slots(n, world);
  ASSERT_EQ(slots.size(), n + 1 + world);
  EXPECT_EQ(slots.used_slot(2), 2u);
  EXPECT_EQ(slots.late_fires_slot(), n);
  EXPECT_EQ(slots.failed_slot(0), n + 1);
  EXPECT_EQ(slots.failed_slot(world - 1), slots.size() - 1);

  std::vector<int32_t> sum(slots.size(), 0), mine(slots.size(), -7);
  for (int r = 0; r < world; ++r) {
    if (r == 4 || r == 12) {
      slots.pack_shadow(mine.data(), r, /*failed=*/true);
    } else {
      std::vector<char> used(n);
      for (size_t j = 0; j < n; ++j) used[j] = (r + j) % 3 == 0;
      slots.pack_step(mine.data(), used, r);
    }
    for (size_t k = 0; k < sum.size(); ++k) sum[k] += mine[k];
  }
  // Users of parameter j among the 11 ranks that stepped: r in [0, 13) \ {4, 12}.
  std::vector<int32_t> users(n, 0);
  for (int r = 0; r < world; ++r)
    for (size_t j = 0; j < n; ++j) users[j] += r != 4 && r != 12 && (r + j) % 3 == 0;
  for (size_t j = 0; j < n; ++j) EXPECT_EQ(slots.used_count(sum.data(), j), users[j]) << j;
  EXPECT_EQ(slots.late_fires(sum.data()), world * (world - 1) / 2 - 4 - 12);
  EXPECT_EQ(slots.failed_ranks(sum.data()), (std::vector<int>{4, 12}));

  // A shadow step that did not fail contributes nothing; an unused parameter stays 0.
  slots.pack_shadow(mine.data(), 5, /*failed=*/false);
  EXPECT_EQ(mine, std::vector<int32_t>(slots.size(), 0));
  slots.pack_step(mine.data(), std::vector<char>(n, 0), 0);
  EXPECT_TRUE(slots.failed_ranks(mine.data()).empty());
  EXPECT_EQ(slots.used_count(mine.data(), 0), 0);

  // No parameters, one rank: one late-fires slot and one failed slot.
  detail::UsedBitmap empty(0, 1);
  EXPECT_EQ(empty.size(), 2u);
}

// --- bucket assignment (no processes) ----------------------------------------------

TEST(BucketAssignment, CapFirstBucketAndReverseOrder) {
  auto ps = make_params({{100}, {100}, {100}, {100}, {100}});  // 400 bytes each
  std::vector<int64_t> reverse = {4, 3, 2, 1, 0};
  // First bucket closes at >= 500 bytes (two tensors), the rest at >= 1000 (three).
  EXPECT_EQ(compute_bucket_assignment(ps, reverse, 1000, 500),
            (std::vector<std::vector<int64_t>>{{4, 3}, {2, 1, 0}}));
  // A cap below one tensor: one bucket each; the first cap never exceeds the cap.
  EXPECT_EQ(compute_bucket_assignment(ps, reverse, 1, 1 << 20),
            (std::vector<std::vector<int64_t>>{{4}, {3}, {2}, {1}, {0}}));
  // Everything fits: one bucket.
  EXPECT_EQ(compute_bucket_assignment(ps, reverse, 1 << 20, 1 << 20),
            (std::vector<std::vector<int64_t>>{{4, 3, 2, 1, 0}}));
}

TEST(BucketAssignment, ExpectedOrderAndDtypeSeparation) {
  auto f = make_params({{10}, {10}, {10}});
  auto d = make_params({{10}, {10}}, at::kDouble);
  std::vector<at::Tensor> ps = {f[0], d[0], f[1], d[1], f[2]};
  std::vector<int64_t> order = {2, 1, 0, 4, 3};
  auto got = compute_bucket_assignment(ps, order, 1 << 20, 1 << 20);
  // One bucket per dtype, ordered by the position of their first tensor in `order`.
  EXPECT_EQ(got, (std::vector<std::vector<int64_t>>{{2, 0, 4}, {1, 3}}));
  // A large tensor alone, closing the running bucket after it.
  auto big = make_params({{10}, {1000}, {10}, {10}});
  EXPECT_EQ(compute_bucket_assignment(big, {0, 1, 2, 3}, 400, 400),
            (std::vector<std::vector<int64_t>>{{0, 1}, {2, 3}}));
}

TEST(BucketAssignment, GroupsNeverShareABucket) {
  // Note [Slices reduce over their rdp group]: tp slices (group 1) and replicated
  // parameters (group 0) run separate buckets, each bucket one group.
  auto ps = make_params({{10}, {10}, {10}, {10}});
  std::vector<int64_t> order = {3, 2, 1, 0};
  EXPECT_EQ(compute_bucket_assignment(ps, order, 1 << 20, 1 << 20, {0, 1, 0, 1}),
            (std::vector<std::vector<int64_t>>{{3, 1}, {2, 0}}));
  EXPECT_EQ(compute_bucket_assignment(ps, order, 1 << 20, 1 << 20, {0, 0, 0, 0}),
            compute_bucket_assignment(ps, order, 1 << 20, 1 << 20));
}

// --- averaging ----------------------------------------------------------------------

// Most tests run twice: buckets summed in shared memory (the ranks share this host)
// and through the Gloo group.
class ReducerPaths : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(Reducer, ReducerPaths, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "SharedMemory" : "Gloo"; });

TEST_P(ReducerPaths, AverageMatchesClosedFormAcrossWorldSizes) {
  const Shapes shapes = {{3, 5}, {7}, {0}, {1}, {2, 2, 3}, {33}};
  for (int n = 1; n <= 4; ++n) {
    for (size_t cap : {size_t{1}, size_t{64}, kDefaultBucketBytesCap}) {
      run_gloo_world(n, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
        auto ps = make_params(shapes);
        ReducerOptions o;
        o.bucket_cap_bytes = cap;
        o.shared_memory = GetParam();
        Reducer red(ps, pg, o);
        EXPECT_EQ(red.shared_memory(), GetParam() && n > 1);
        for (int s = 0; s < 3; ++s) {
          zero_grads(ps, s % 2 == 0);
          step(red, linear_loss(ps, r + 1));
          for (size_t i = 0; i < ps.size(); ++i)
            expect_all(ps[i].grad(), (n + 1) / 2.0, 1e-6,
                       str_cat("n=", n, " cap=", cap, " step ", s, " param ", i));
        }
      });
    }
  }
}

TEST_P(ReducerPaths, GradScaleAndMixedDtypes) {
  run_gloo_world(3, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto f = make_params({{4, 4}, {5}});
    auto d = make_params({{6}}, at::kDouble);
    std::vector<at::Tensor> ps = {f[0], d[0], f[1]};
    ReducerOptions o;
    o.shared_memory = GetParam();
    Reducer red(ps, pg, o);
    EXPECT_EQ(red.bucket_indices().size(), 2u);  // float and double buckets
    step(red, linear_loss(ps, r + 1), 0.5);
    for (size_t i = 0; i < ps.size(); ++i) expect_all(ps[i].grad(), 0.5 * 2.0, 1e-6, str_cat(i));
  });
}

// Note [Slices reduce over their rdp group]: 4 ranks as tp=2 x rdp=2 (tp rank r % 2,
// rdp groups {0, 2} and {1, 3}). Replicated parameters average over all 4; slices sum
// over their rdp group and divide by 4 (each rank's batch), or by 2 with
// prescaled_batch; with any bucket size, across the rebuild, in shared memory or not.
// A comm hook is refused, naming both.
TEST_P(ReducerPaths, SlicesReduceOverTheirRdpGroup) {
  const Shapes shapes = {{3, 5}, {7}, {4}, {2, 3}};
  for (bool prescaled : {false, true}) {
    for (size_t cap : {size_t{1}, kDefaultBucketBytesCap}) {
      run_gloo_world(4, [&](int r, const ProcessGroupPtr& pg, const StorePtr& store) {
        auto rdp_store = c10::make_intrusive<c10d::PrefixStore>(
            str_cat("rdp", r % 2, prescaled, cap), store);
        auto rdp = compat::make_gloo_group(rdp_store, r / 2, 2, std::chrono::milliseconds(10000),
                                           "127.0.0.1");
        auto ps = make_params(shapes);
        ReducerOptions o;
        o.bucket_cap_bytes = cap;
        o.shared_memory = GetParam();
        o.sliced = {0, 1, 0, 1};
        o.slice_group = rdp;
        o.prescaled_batch = prescaled;
        Reducer red(ps, pg, o);
        EXPECT_TRUE(red.sliced());
        EXPECT_EQ(red.shared_memory(), GetParam());
        for (const auto& b : red.bucket_indices())
          for (int64_t i : b) EXPECT_EQ(o.sliced[i], o.sliced[b.front()]) << "a mixed bucket";
        const double slice_sum = r % 2 == 0 ? 1 + 3 : 2 + 4;  // (r + 1) over the rdp group
        for (int s = 0; s < 3; ++s) {
          zero_grads(ps, s % 2 == 0);
          step(red, linear_loss(ps, r + 1));
          for (size_t i = 0; i < ps.size(); ++i)
            expect_all(ps[i].grad(), o.sliced[i] ? slice_sum / (prescaled ? 2 : 4) : 2.5, 1e-6,
                       str_cat("prescaled=", prescaled, " cap=", cap, " step ", s, " param ", i));
        }
        try {
          red.register_comm_hook(std::make_shared<RecordingHook>());
          ADD_FAILURE() << "a comm hook was accepted with slices";
        } catch (const ConfigError& e) {
          EXPECT_NE(std::string(e.what()).find("_smp_tp_dim"), std::string::npos) << e.what();
        }
      });
    }
  }
}

// Note [Slices reduce over their rdp group] with owners (optimizer-state sharding): a
// slice's owner is a rank of its rdp group and only it keeps the slice's reduced
// gradient; replicated parameters are owned by dp ranks as without tp. 4 ranks as
// tp=2 x rdp=2 (rdp groups {0, 2} and {1, 3}, rdp rank r / 2).
TEST_P(ReducerPaths, SlicesReduceToTheirRdpOwners) {
  const Shapes shapes = {{3, 5}, {7}, {4}, {2, 3}, {6}, {5}};
  for (bool prescaled : {false, true}) {
    for (size_t cap : {size_t{1}, kDefaultBucketBytesCap}) {
      run_gloo_world(4, [&](int r, const ProcessGroupPtr& pg, const StorePtr& store) {
        auto rdp_store = c10::make_intrusive<c10d::PrefixStore>(
            str_cat("rdp-owners", r % 2, prescaled, cap), store);
        auto rdp = compat::make_gloo_group(rdp_store, r / 2, 2, std::chrono::milliseconds(10000),
                                           "127.0.0.1");
        auto ps = make_params(shapes);
        ReducerOptions o;
        o.bucket_cap_bytes = cap;
        o.shared_memory = GetParam();
        o.sliced = {0, 1, 0, 1, 1, 0};
        o.owners = {3, 1, -1, 0, 1, 2};  // slices: rdp ranks; the rest: dp ranks
        o.slice_group = rdp;
        o.prescaled_batch = prescaled;
        Reducer red(ps, pg, o);
        EXPECT_EQ(red.shared_memory(), GetParam());
        const double slice_sum = r % 2 == 0 ? 1 + 3 : 2 + 4;  // (r + 1) over the rdp group
        for (int s = 0; s < 3; ++s) {
          zero_grads(ps, s % 2 == 0);
          step(red, linear_loss(ps, r + 1));
          for (size_t i = 0; i < ps.size(); ++i) {
            const std::string what = str_cat("prescaled=", prescaled, " cap=", cap, " step ", s,
                                             " param ", i);
            const bool mine = o.owners[i] < 0 || o.owners[i] == (o.sliced[i] ? r / 2 : r);
            if (mine)
              expect_all(ps[i].grad(), o.sliced[i] ? slice_sum / (prescaled ? 2 : 4) : 2.5,
                         1e-6, what);
            else
              EXPECT_FALSE(ps[i].grad().defined()) << what << ": kept by another rank";
          }
        }
        ReducerOptions bad = o;
        bad.owners = {3, 2, -1, 0, 1, 2};  // a slice owned by dp rank 2: not an rdp rank
        EXPECT_THROW(Reducer(make_params(shapes), pg, bad), ConfigError);
      });
    }
  }
}

// Note [Reduce to owner]: each rank keeps the average of the gradients it owns (and of
// those every rank keeps, owner -1); the others' .grad is None after every step, with
// any bucket size, accumulation without sync in between, and a rebuild.
TEST_P(ReducerPaths, OwnersKeepOnlyTheirGradients) {
  const Shapes shapes = {{3, 5}, {7}, {1}, {2, 2, 3}, {33}, {4}};
  for (int n : {2, 3}) {
    for (size_t cap : {size_t{1}, size_t{64}, kDefaultBucketBytesCap}) {
      run_gloo_world(n, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
        auto ps = make_params(shapes);
        ReducerOptions o;
        o.bucket_cap_bytes = cap;
        o.shared_memory = GetParam();
        o.owners = {1 % n, 0, -1, 2 % n, 0, 1 % n};
        Reducer red(ps, pg, o);
        for (const auto& b : red.bucket_indices())  // grouped by owner, -1 last
          for (size_t k = 1; k < b.size(); ++k) {
            auto key = [&](int64_t i) { return o.owners[i] < 0 ? n : o.owners[i]; };
            EXPECT_LE(key(b[k - 1]), key(b[k]));
          }
        for (int s = 0; s < 3; ++s) {
          zero_grads(ps, s % 2 == 0);
          if (s == 2) {  // accumulate once without sync: twice the gradient
            red.prepare_for_backward(false);
            linear_loss(ps, r + 1).backward();
          }
          step(red, linear_loss(ps, r + 1));
          for (size_t i = 0; i < ps.size(); ++i) {
            const std::string what = str_cat("n=", n, " cap=", cap, " step ", s, " param ", i);
            if (o.owners[i] < 0 || o.owners[i] == r)
              expect_all(ps[i].grad(), (s == 2 ? 2 : 1) * (n + 1) / 2.0, 1e-6, what);
            else
              EXPECT_FALSE(ps[i].grad().defined()) << what << ": kept by another rank";
          }
        }
      });
    }
  }
}

TEST(Reducer, OwnersRefuseCommHooksAndBadOwners) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{4}, {5}});
    ReducerOptions o;
    o.owners = {0, 1};
    Reducer red(ps, pg, o);
    try {
      red.register_comm_hook(std::make_shared<RecordingHook>());
      ADD_FAILURE() << "a comm hook was accepted with owners";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("'shard_optimizer_state'=true"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("'recording'"), std::string::npos) << e.what();
    }
    ReducerOptions bad;
    bad.owners = {0, 2};
    EXPECT_THROW(Reducer(ps, pg, bad), ConfigError);
  });
}

TEST(Reducer, NoSyncAccumulatesWithoutCommunication) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{8}, {3, 3}});
    ReducerOptions o;
    o.bucket_cap_bytes = 1;
    Reducer red(ps, pg, o);
    auto hook = std::make_shared<RecordingHook>();
    red.register_comm_hook(hook);
    for (int mb = 0; mb < 2; ++mb) {
      auto loss = linear_loss(ps, r + 1);
      red.prepare_for_backward(false, 1.0, {loss});
      loss.backward();
    }
    EXPECT_TRUE(hook->calls.empty());
    for (auto& p : ps) expect_all(p.grad(), 2.0 * (r + 1), 1e-6, "local accumulation");
    step(red, linear_loss(ps, r + 1));
    EXPECT_EQ(hook->calls.size(), 2u);
    for (auto& p : ps) expect_all(p.grad(), 3.0 * 1.5, 1e-6, "average of the sums");
  });
}

TEST(Reducer, OverlappingOffGivesTheSameResult) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{8}, {3, 3}, {5}});
    ReducerOptions o;
    o.bucket_cap_bytes = 1;
    o.overlapping = false;
    Reducer red(ps, pg, o);
    for (int s = 0; s < 2; ++s) {
      zero_grads(ps, true);
      step(red, linear_loss(ps, r + 1));
      for (auto& p : ps) expect_all(p.grad(), 1.5, 1e-6, "no overlap");
    }
  });
}

// --- hooks --------------------------------------------------------------------------

TEST(Reducer, HookRunsOncePerBucketWithTheBucketsContents) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{4, 2}, {4}, {3}});
    ReducerOptions o;
    o.bucket_cap_bytes = 20;  // {3}: 12 B, then {4}+... : buckets [[2, 1], [0]]
    o.first_bucket_bytes = 20;
    Reducer red(ps, pg, o);
    ASSERT_EQ(red.bucket_indices(), (std::vector<std::vector<int64_t>>{{2, 1}, {0}}));
    auto hook = std::make_shared<RecordingHook>();
    red.register_comm_hook(hook);
    for (int s = 0; s < 3; ++s) {
      zero_grads(ps, true);
      step(red, linear_loss(ps, r + 1));
    }
    ASSERT_EQ(hook->calls.size(), 6u);
    for (int s = 0; s < 3; ++s) {
      const auto& a = hook->calls[2 * s];
      const auto& b = hook->calls[2 * s + 1];
      EXPECT_EQ(a.index, 0u);
      EXPECT_EQ(b.index, 1u);
      EXPECT_FALSE(a.last);
      EXPECT_TRUE(b.last);
      EXPECT_EQ(a.numel, 7);
      EXPECT_EQ(a.param_shapes, (std::vector<std::vector<int64_t>>{{3}, {4}}));
      EXPECT_EQ(a.grad_shapes, a.param_shapes);
      EXPECT_EQ(b.param_shapes, (std::vector<std::vector<int64_t>>{{4, 2}}));
      // A custom hook sees the raw local gradients (no averaging before it).
      EXPECT_DOUBLE_EQ(a.sum, 7.0 * (r + 1));
      EXPECT_DOUBLE_EQ(b.sum, 8.0 * (r + 1));
    }
    for (auto& p : ps) expect_all(p.grad(), 1.5, 1e-6, "hook average");
  });
}

// The pattern torch's Gloo PowerSGD gets wrong (FACTS.md): the second collective of a
// bucket is issued from the first one's completion callback on a Gloo thread. Through
// the ordered queue, many buckets still pair up correctly on every rank.
class ChainedCallbackHook : public CommHook {
 public:
  FuturePtr run(GradBucket& b) override {
    auto pg = b.process_group();
    at::Tensor buf = b.buffer();
    auto out = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    std::vector<at::Tensor> v{buf};
    pg->allreduce(v)->getFuture()->addCallback([pg, buf, out](c10::ivalue::Future&) {
      buf.div_(pg->getSize() * pg->getSize());  // sum / n^2 ...
      std::vector<at::Tensor> v2{buf};
      pg->allreduce(v2)->getFuture()->addCallback([buf, out](c10::ivalue::Future& f) {
        if (f.hasError()) {
          out->setError(f.exception_ptr());
        } else {
          out->markCompleted(buf);  // ... summed again: the mean
        }
      });
    });
    return out;
  }
  std::string name() const override { return "chained-callback"; }
};

// The same two collectives issued in sequence from run() on the comm thread.
class ChainedSyncHook : public CommHook {
 public:
  FuturePtr run(GradBucket& b) override {
    auto pg = b.process_group();
    at::Tensor buf = b.buffer();
    std::vector<at::Tensor> v{buf};
    wait_future(pg->allreduce(v)->getFuture(), 10, "first allreduce");
    buf.div_(pg->getSize() * pg->getSize());
    return pg->allreduce(v)->getFuture();
  }
  std::string name() const override { return "chained-sync"; }
};

TEST(Reducer, HooksChainingTwoCollectivesWithManyBuckets) {
  for (int kind = 0; kind < 2; ++kind) {
    run_gloo_world(3, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
      Shapes shapes;
      for (int i = 0; i < 40; ++i) shapes.push_back({1 + (i * 37) % 300});
      auto ps = make_params(shapes);
      ReducerOptions o;
      o.bucket_cap_bytes = 1;  // one bucket per parameter
      Reducer red(ps, pg, o);
      if (kind == 0) {
        red.register_comm_hook(std::make_shared<ChainedCallbackHook>());
      } else {
        red.register_comm_hook(std::make_shared<ChainedSyncHook>());
      }
      for (int s = 0; s < 5; ++s) {
        zero_grads(ps, s % 2 == 1);
        step(red, linear_loss(ps, r + 1));
        for (size_t i = 0; i < ps.size(); ++i)
          expect_all(ps[i].grad(), 2.0, 1e-5, str_cat("kind ", kind, " step ", s, " param ", i));
      }
    });
  }
}

TEST(Reducer, RegisterCommHookOnlyOnceBeforeTheFirstStep) {
  run_gloo_world(1, [&](int, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{3}});
    Reducer red(ps, pg);
    red.register_comm_hook(std::make_shared<RecordingHook>());
    try {
      red.register_comm_hook(std::make_shared<RecordingHook>());
      FAIL() << "second registration accepted";
    } catch (const std::logic_error& e) {
      EXPECT_STREQ(e.what(), "smp: register_comm_hook must be called once, before the first step");
    }
    Reducer red2(ps, pg);
    step(red2, linear_loss(ps, 1));
    EXPECT_THROW(red2.register_comm_hook(std::make_shared<RecordingHook>()), std::logic_error);
  });
}

// A hook whose future never completes: finalize times out naming bucket and group, on
// every rank; the reducer then refuses further steps.
class NeverHook : public CommHook {
 public:
  FuturePtr run(GradBucket&) override {
    return c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  }
  std::string name() const override { return "never"; }
};

TEST(Reducer, HookTimeoutNamesBucketAndGroup) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{3}});
    ReducerOptions o;
    o.timeout_s = 0.3;
    Reducer red(ps, pg, o);
    red.register_comm_hook(std::make_shared<NeverHook>());
    try {
      step(red, linear_loss(ps, 1));
      FAIL() << "finalize returned";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find(str_cat(
                    "waiting for bucket 0 of 1 (comm hook 'never') on the dp process group "
                    "(gloo, rank ", r, " of 2)")),
                std::string::npos)
          << e.what();
    }
    try {
      red.prepare_for_backward(true, 1.0, {});
      FAIL() << "a broken reducer accepted a step";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("unusable after an earlier failure"), std::string::npos);
    }
  });
}

// --- unused parameters ----------------------------------------------------------------

TEST_P(ReducerPaths, UnusedParametersNeverHang) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{4}, {5}, {6}, {7}});  // 0: all, 1: rank 0 only, 2: none, 3: all
    for (bool view : {false, true}) {
      for (auto p : ps) p.mutable_grad() = at::Tensor();
      ReducerOptions o;
      o.bucket_cap_bytes = 1;
      o.gradient_as_bucket_view = view;
      o.shared_memory = GetParam();
      Reducer red(ps, pg, o);
      for (int s = 0; s < 3; ++s) {
        zero_grads(ps, true);
        std::vector<at::Tensor> used = {ps[0], ps[3]};
        if (r == 0) used.push_back(ps[1]);
        auto st = step(red, linear_loss(used, r + 1));
        expect_all(ps[0].grad(), 1.5, 1e-6, "used everywhere");
        expect_all(ps[3].grad(), 1.5, 1e-6, "used everywhere");
        expect_all(ps[1].grad(), 0.5, 1e-6, "used on rank 0 only");  // (1 + 0) / 2
        EXPECT_FALSE(ps[2].grad().defined()) << "unused everywhere must stay None";
        EXPECT_EQ(st.unused_global, 1);
        EXPECT_EQ(st.unused_local, r == 0 ? 1 : 2);
      }
    }
  });
}

TEST(Reducer, EmptyOutputsMeanGradientsAreFinal) {
  // The pipeline's way: backward ran before prepare_for_backward(sync=true, outputs={}).
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{4}, {5}});
    Reducer red(ps, pg);
    linear_loss(ps, r + 1).backward();
    red.prepare_for_backward(true, 1.0, {});
    red.finalize();
    for (auto& p : ps) expect_all(p.grad(), 1.5, 1e-6, "final grads");
  });
}

// --- gradient_as_bucket_view ------------------------------------------------------------

TEST_P(ReducerPaths, GradientAsBucketViewAliasesTheBucket) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{4, 3}, {5}, {2}});
    ReducerOptions o;
    o.gradient_as_bucket_view = true;
    o.shared_memory = GetParam();
    // A gradient from before the reducer existed is copied into the bucket.
    ps[1].mutable_grad() = torch::full({5}, 100.0);
    Reducer red(ps, pg, o);
    ASSERT_EQ(red.bucket_indices(), (std::vector<std::vector<int64_t>>{{2, 1, 0}}));
    expect_all(ps[1].grad(), 100.0, 0, "copied into the bucket");
    zero_grads(ps, false);
    std::vector<void*> ptrs;
    for (int s = 0; s < 4; ++s) {
      // Alternate the two zero_grad flavours; set_to_none must be re-pointed.
      zero_grads(ps, s % 2 == 1);
      step(red, linear_loss(ps, r + 1));
      for (auto& p : ps) expect_all(p.grad(), 1.5, 1e-6, str_cat("step ", s));
      // Bucket order [2, 1, 0]: the grads sit back to back in one buffer.
      auto* base = ps[2].grad().data_ptr<float>();
      EXPECT_EQ(ps[1].grad().data_ptr<float>(), base + 2);
      EXPECT_EQ(ps[0].grad().data_ptr<float>(), base + 7);
      ptrs.push_back(base);
    }
    for (auto* p : ptrs) EXPECT_EQ(p, ptrs[0]) << "the bucket moved";
    // libtorch's Optimizer::zero_grad detach_()es grads: they must not be autograd views.
    torch::optim::SGD opt(ps, 0.1);
    opt.zero_grad();
    step(red, linear_loss(ps, r + 1));
    EXPECT_EQ(ps[2].grad().data_ptr<float>(), ptrs[0]);
  });
}

// --- rebuild ---------------------------------------------------------------------------

TEST_P(ReducerPaths, RebuildFollowsRankZerosReadyOrder) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    const int n = 6;
    auto ps = make_params(Shapes(n, {4}));
    ReducerOptions o;
    o.bucket_cap_bytes = 1;
    o.shared_memory = GetParam();
    o.expected_order = {0, 1, 2, 3, 4, 5};  // wrong: gradients arrive in another order
    Reducer red(ps, pg, o);
    // A chain h = x * p[c0] * p[c1] ...: gradients become ready from the last factor
    // back. The ranks chain in different orders; rank 0's order must win on both.
    std::vector<int> chain = r == 0 ? std::vector<int>{1, 3, 5, 0, 2, 4}
                                    : std::vector<int>{5, 4, 3, 2, 1, 0};
    for (int s = 0; s < 3; ++s) {
      zero_grads(ps, true);
      at::Tensor h = torch::ones({4});
      for (int c : chain) h = h * ps[c];
      auto loss = h.sum();
      // Expected: the mean over ranks of the local gradients.
      auto local = torch::autograd::grad({loss}, ps, {}, /*retain_graph=*/true);
      std::vector<at::Tensor> mean;
      for (auto& g : local) {
        std::vector<at::Tensor> v{g.clone()};
        pg->allreduce(v)->wait();
        mean.push_back(v[0] / 2);
      }
      step(red, loss);
      for (int i = 0; i < n; ++i)
        EXPECT_TRUE(torch::allclose(ps[i].grad(), mean[i], 1e-5, 1e-6)) << "step " << s << " param " << i;
      if (s == 0) {
        EXPECT_TRUE(red.rebuilt());
        EXPECT_TRUE(red.stats().rebuilt);
        EXPECT_EQ(red.bucket_indices(),
                  (std::vector<std::vector<int64_t>>{{4}, {2}, {0}, {5}, {3}, {1}}));
      } else {
        EXPECT_FALSE(red.stats().rebuilt);  // once only
      }
    }
  });
}

TEST(Reducer, NoRebuildWhenTheOrderWasRight) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params(Shapes(4, {4}));
    ReducerOptions o;
    o.bucket_cap_bytes = 1;
    Reducer red(ps, pg, o);  // reverse registration: right for a forward chain
    auto before = red.bucket_indices();
    at::Tensor h = torch::ones({4});
    for (auto& p : ps) h = h * p;
    step(red, h.sum() * (r + 1));
    EXPECT_FALSE(red.rebuilt());
    EXPECT_EQ(red.bucket_indices(), before);
  });
}

// --- Join shadow step --------------------------------------------------------------------

TEST_P(ReducerPaths, ShadowStepMatchesAPeersCollectives) {
  for (bool custom_hook : {true, false}) {
    for (bool view : {false, true}) {
      run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
        auto ps = make_params({{3}, {5}, {7}});
        ReducerOptions o;
        o.bucket_cap_bytes = 1;
        o.shared_memory = GetParam();
        o.gradient_as_bucket_view = view;
        Reducer red(ps, pg, o);
        if (custom_hook) red.register_comm_hook(std::make_shared<ChainedCallbackHook>());
        for (int s = 0; s < 3; ++s) {
          if (r == 1 && s >= 1) {
            // Rank 1 ran out of data: zeros, the same collectives, its .grad untouched.
            red.run_shadow_step();
            for (auto& p : ps) expect_all(p.grad(), 1.5, 1e-6, "shadow rank keeps its grads");
            continue;
          }
          zero_grads(ps, true);
          step(red, linear_loss(ps, r + 1));
          for (auto& p : ps)
            expect_all(p.grad(), s == 0 ? 1.5 : 0.5, 1e-6,
                       str_cat("hook ", custom_hook, " view ", view, " step ", s));
        }
      });
    }
  }
}

// Ranks 1 and 2 of 3 cannot run step 1 (fail_step); rank 0, which ran it, raises in
// finalize() naming both, through the used bitmap's failed slots (Note [Used bitmap]).
TEST_P(ReducerPaths, FailStepNamesTheFailedRanksOnTheOthers) {
  run_gloo_world(3, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{3}, {5}});
    ReducerOptions o;
    o.bucket_cap_bytes = 1;
    o.shared_memory = GetParam();
    Reducer red(ps, pg, o);
    if (r > 0) {
      red.fail_step();  // returns: a failed rank raises its own error, not this one
      return;
    }
    try {
      step(red, linear_loss(ps, 1));
      FAIL() << "finalize returned";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "smp: dp rank(s) 1,2 of the dp process group (gloo, rank 0 of 3) could "
                    "not run step 1 (see the error raised there"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(Reducer, SharedMemoryPeerThatNeverArrivesTimesOut) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{3}});
    ReducerOptions o;
    o.timeout_s = 0.3;
    Reducer red(ps, pg, o);
    ASSERT_TRUE(red.shared_memory());
    if (r == 1) return;  // never steps
    try {
      step(red, linear_loss(ps, 1));
      FAIL() << "finalize returned";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "waiting for bucket 0 of 1 (shared memory) on the dp process group (gloo, "
                    "rank 0 of 2) in step 1: rank(s) 1 did not reach it"),
                std::string::npos)
          << e.what();
    }
  });
}

// --- CommQueue ------------------------------------------------------------------------

TEST(CommQueue, RunsInOrderAndFailsLaterTasksAfterAnError) {
  CommQueue q("test");
  std::vector<int> seen;
  std::vector<CommQueue::TicketPtr> ts;
  for (int i = 0; i < 50; ++i) ts.push_back(q.submit(str_cat("task ", i), [&, i] { seen.push_back(i); }));
  for (auto& t : ts) q.wait(t, 5);
  std::vector<int> want(50);
  std::iota(want.begin(), want.end(), 0);
  EXPECT_EQ(seen, want);
  auto bad = q.submit("bad task", [] { throw CommError("smp: boom"); });
  auto later = q.submit("later task", [&] { seen.push_back(-1); });
  EXPECT_THROW(q.wait(bad, 5), CommError);
  try {
    q.wait(later, 5);
    FAIL();
  } catch (const CommError& e) {
    EXPECT_STREQ(e.what(), "smp: later task was not run: an earlier communication task on test "
                           "failed (smp: boom)");
  }
  EXPECT_EQ(seen.back(), 49);
  CommQueue q2("test2");
  auto slow = q2.submit("slow task", [] { std::this_thread::sleep_for(std::chrono::milliseconds(300)); });
  try {
    q2.wait(slow, 0.05);
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_STREQ(e.what(), "smp: timed out after 0.05 s waiting for slow task on test2");
  }
}

// --- broadcast_coalesced and DistributedModel --------------------------------------------

TEST(BroadcastCoalesced, CopiesRootsTensorsInPlace) {
  run_gloo_world(3, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    std::vector<at::Tensor> ts = {torch::full({3, 3}, r + 1.0), torch::full({5}, r + 10.0, at::kDouble),
                                  torch::full({0}, 1.0), torch::full({200}, r * 2.0),
                                  torch::full({2}, r + 1.0).requires_grad_()};
    auto t4 = ts[3].narrow(0, 0, 100);  // non-contiguous-free view, but not the whole storage
    broadcast_coalesced(pg, ts, 1, /*bucket_bytes=*/64, 10);
    expect_all(ts[0], 2.0, 0, "float");
    expect_all(ts[1], 11.0, 0, "double");
    expect_all(ts[3], 2.0, 0, "large");
    expect_all(ts[4], 2.0, 0, "requires_grad leaf");
    expect_all(t4, 2.0, 0, "alias");
  });
}

TEST(DistributedModel, MatchesOneProcessOnTheWholeBatch) {
  // Threads share torch's default generator: draw everything here, up front.
  const int n = 2, steps = 4;
  auto gen = at::detail::createCPUGenerator(3);
  auto make_net = [&] {
    auto net = torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(),
                                     torch::nn::Linear(16, 3));
    torch::NoGradGuard g;
    for (auto& p : net->parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.3);
    return net;
  };
  std::vector<std::vector<std::pair<at::Tensor, at::Tensor>>> data(steps);
  for (int s = 0; s < steps; ++s)
    for (int r = 0; r < n; ++r)
      data[s].emplace_back(torch::randn({8, 6}, gen), torch::randn({8, 3}, gen));
  auto ref = make_net();
  std::vector<at::Tensor> initial;
  for (auto& p : ref->parameters()) initial.push_back(p.detach().clone());
  // Reference: one process, both ranks' batches at once.
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  for (int s = 0; s < steps; ++s) {
    auto x = torch::cat({data[s][0].first, data[s][1].first});
    auto y = torch::cat({data[s][0].second, data[s][1].second});
    torch::mse_loss(ref->forward(x), y).backward();
    ref_opt.step();
    ref_opt.zero_grad();
  }
  for (bool view : {false, true}) {
    std::vector<std::vector<at::Tensor>> finals(n);
    std::vector<torch::nn::Sequential> nets = {make_net(), make_net()};  // they differ
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < initial.size(); ++i) nets[0]->parameters()[i].copy_(initial[i]);
    }
    run_gloo_world(n, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
      auto net = nets[r];
      DistributedModelOptions o;
      o.gradient_as_bucket_view = view;
      o.bucket_cap_bytes = 200;
      DistributedModel model(net.ptr(), o, pg);  // the first forward broadcasts rank 0's
      torch::optim::SGD opt(net->parameters(), 0.1);
      for (int s = 0; s < steps; ++s) {
        model.backward(torch::mse_loss(model(data[s][r].first), data[s][r].second));
        opt.step();
        opt.zero_grad();
      }
      for (auto& p : net->parameters()) finals[r].push_back(p.detach().clone());
    });
    auto want = ref->parameters();
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_TRUE(torch::allclose(finals[r][i], want[i], 1e-5, 1e-6))
            << "view=" << view << " rank " << r << " param " << i;
  }
}

// A backward that throws on one rank: that rank rethrows its own error, and the other
// raises in its reduction naming it (Note [Failed rank]), instead of waiting for it
// until the timeout: its message names the rank (a timeout would name what it awaited).
struct ThrowsInBackward : torch::autograd::Function<ThrowsInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    throw std::runtime_error("kaboom in backward\nsecond line");
  }
};

TEST(DistributedModel, ABackwardThatThrowsNamesTheRankOnItsPeers) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 2));
    DistributedModelOptions o;
    o.timeout_s = 20;
    DistributedModel model(net.ptr(), o, pg);
    at::Tensor out = model(torch::ones({3, 4}));
    if (r == 1) out = ThrowsInBackward::apply(out);
    try {
      model.backward(out.sum());
      FAIL() << "rank " << r << ": backward returned";
    } catch (const CommError& e) {
      EXPECT_EQ(r, 0);
      EXPECT_NE(std::string(e.what()).find("dp rank(s) 1 of the dp process group"),
                std::string::npos)
          << e.what();
    } catch (const std::exception& e) {
      EXPECT_EQ(r, 1) << e.what();
      EXPECT_NE(std::string(e.what()).find("kaboom in backward"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace smp
