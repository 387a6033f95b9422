// ReplicaStep, the data-parallel step policy, over real Gloo ranks (threads,
// tests/cpp/common/gloo_world.h). Closed-form answers: rank r's tensors hold r+1 (or a
// value made from r), so rank 0's value and the average (n+1)/2 are known.
#include "smp_core/replica_step.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../common/gloo_world.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using testing::run_gloo_world;

void expect_all(const at::Tensor& t, double v, const std::string& what) {
  ASSERT_TRUE(t.defined()) << what << ": undefined";
  EXPECT_EQ(t.min().item<double>(), v) << what;
  EXPECT_EQ(t.max().item<double>(), v) << what;
}

// A loss whose gradient is `value` in every element of each parameter.
at::Tensor linear_loss(const std::vector<at::Tensor>& ps, double value) {
  at::Tensor loss = torch::zeros({}, at::kDouble);
  for (const auto& p : ps) loss = loss + (p * value).sum().to(at::kDouble);
  return loss;
}

// The first forward takes rank 0's parameters and buffers, later ones its buffers only;
// no buffers broadcast when broadcast_buffers is off, none when there are none, and
// nothing at all when the replica does not reduce.
TEST(ReplicaStep, FirstForwardBroadcastsStateLaterOnlyBuffers) {
  for (int n : {1, 2, 3}) {
    run_gloo_world(n, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
      std::vector<at::Tensor> params = {torch::full({3, 2}, r + 1.0).requires_grad_(),
                                        torch::full({0}, r + 1.0),
                                        torch::full({5}, r + 1.0, at::kDouble)};
      std::vector<at::Tensor> buffers = {torch::full({4}, r + 10.0),
                                         torch::full({1}, r + 10L, at::kLong)};
      ReplicaStep step(pg);
      EXPECT_EQ(step.forward_sync(true), ForwardSync::kState);
      EXPECT_EQ(step.sync_before_forward(params, buffers), ForwardSync::kState);
      expect_all(params[0], 1.0, "param 0 after the first forward");
      expect_all(params[2], 1.0, "param 2 after the first forward");
      expect_all(buffers[0], 10.0, "buffer 0 after the first forward");
      expect_all(buffers[1], 10.0, "buffer 1 after the first forward");
      EXPECT_TRUE(params[0].requires_grad());
      {
        torch::NoGradGuard g;
        for (auto& p : params) p.fill_(r + 30.0);
        for (auto& b : buffers) b.fill_(r + 20.0);
      }
      EXPECT_EQ(step.sync_before_forward(params, buffers), ForwardSync::kBuffers);
      expect_all(params[0], r + 30.0, "param 0 after a later forward (not broadcast)");
      expect_all(buffers[0], 20.0, "buffer 0 after a later forward");
      expect_all(buffers[1], 20.0, "buffer 1 after a later forward");
      EXPECT_EQ(step.sync_before_forward(params, {}), ForwardSync::kNothing);
      EXPECT_EQ(step.forward_sync(false), ForwardSync::kNothing);

      ReplicaStepOptions off;
      off.broadcast_buffers = false;
      ReplicaStep quiet(pg, off);
      EXPECT_EQ(quiet.sync_before_forward(params, buffers), ForwardSync::kState);
      {
        torch::NoGradGuard g;
        for (auto& b : buffers) b.fill_(r + 40.0);
      }
      EXPECT_EQ(quiet.sync_before_forward(params, buffers), ForwardSync::kNothing);
      expect_all(buffers[0], r + 40.0, "buffer 0, broadcast_buffers off");

      ReplicaStepOptions alone;
      alone.reduces = false;
      ReplicaStep single(pg, alone);
      EXPECT_EQ(single.sync_before_forward(params, buffers), ForwardSync::kNothing);
      expect_all(buffers[0], r + 40.0, "buffer 0, not reducing");
    });
  }
}

// backward_passes_per_step=2: the first step only accumulates (no collective: rank r
// keeps r+1), the second reduces the sum: the average of 2(r+1) is n+1. Within a step
// only the last microbatch arms the reducer.
TEST(ReplicaStep, NoSyncStepsAccumulateAndTheSyncStepReducesTheSum) {
  for (int n : {1, 2, 3}) {
    run_gloo_world(n, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
      std::vector<at::Tensor> ps = {torch::zeros({3}).requires_grad_(),
                                    torch::zeros({1}).requires_grad_(),
                                    torch::zeros({7}).requires_grad_()};
      ReducerOptions ro;
      ro.bucket_cap_bytes = 8;
      Reducer reducer(ps, pg, ro);
      ReplicaStepOptions so;
      so.backward_passes_per_step = 2;
      ReplicaStep step(pg, so);
      EXPECT_FALSE(step.next_step_syncs());
      EXPECT_FALSE(step.begin_step());
      EXPECT_EQ(step.steps(), 1);
      step.begin_microbatch(/*last=*/true);
      auto loss = linear_loss(ps, r + 1.0);
      step.prepare_for_backward(reducer, {loss});
      loss.backward();
      EXPECT_FALSE(step.armed());
      EXPECT_EQ(step.end_step(&reducer).buckets, 0);
      for (size_t i = 0; i < ps.size(); ++i)
        expect_all(ps[i].grad(), r + 1.0, str_cat("no_sync p", i));
      EXPECT_EQ(reducer.steps_run(), 0);

      EXPECT_TRUE(step.next_step_syncs());
      EXPECT_TRUE(step.begin_step());
      for (int mb = 0; mb < 2; ++mb) {  // two microbatches of (r+1)/2 each
        step.begin_microbatch(/*last=*/mb == 1);
        auto l = linear_loss(ps, (r + 1.0) / 2);
        step.prepare_for_backward(reducer, {l});
        EXPECT_EQ(step.armed(), mb == 1) << "microbatch " << mb;
        l.backward();
      }
      EXPECT_GT(step.end_step(&reducer).buckets, 0);
      EXPECT_EQ(reducer.steps_run(), 1);
      for (size_t i = 0; i < ps.size(); ++i)
        expect_all(ps[i].grad(), n + 1.0, str_cat("sync p", i));

      // The caller decides a step's sync (Join's announce; smp::DistributedModel).
      EXPECT_FALSE(step.begin_step());
      step.set_sync_step(true);
      EXPECT_TRUE(step.sync_step());
      EXPECT_FALSE(step.armed());
    });
  }
}

TEST(ReplicaStep, RefusesBackwardPassesPerStepBelowOne) {
  run_gloo_world(1, [&](int, const ProcessGroupPtr& pg, const StorePtr&) {
    ReplicaStepOptions o;
    o.backward_passes_per_step = 0;
    try {
      ReplicaStep step(pg, o);
      FAIL() << "constructed";
    } catch (const ConfigError& e) {
      EXPECT_STREQ(e.what(), "smp: ReplicaStep backward_passes_per_step=0 must be >= 1");
    }
  });
}

// A failed step's choice against real peers: rank 1 fails, rank 0 runs the step.
// - not armed, synchronizing: a flagged shadow step; rank 0 raises naming rank 1;
// - armed: the rest of the step, flagged; rank 0 raises naming rank 1;
// - a step that does not synchronize: the failure is posted in the store for the
//   reduction rank 0 will wait in;
// - no reducer yet, or not reducing: nothing.
TEST(ReplicaStep, AFailedStepTellsThePeersTheWayTheStepAllows) {
  for (bool armed : {false, true}) {
    run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
      std::vector<at::Tensor> ps = {torch::zeros({3}).requires_grad_(),
                                    torch::zeros({5}).requires_grad_()};
      ReducerOptions ro;
      ro.bucket_cap_bytes = 1;
      ro.timeout_s = 5;
      Reducer reducer(ps, pg, ro);
      ReplicaStep step(pg);
      ASSERT_TRUE(step.begin_step());
      step.begin_microbatch(true);
      auto loss = linear_loss(ps, 1.0);
      if (r == 1) {
        if (armed) step.prepare_for_backward(reducer, {loss});  // then backward "raises"
        EXPECT_EQ(step.armed(), armed);
        EXPECT_EQ(step.fail_step(&reducer, step.sync_step(), step.armed(), "ValueError: bad"),
                  armed ? StepFailure::kAbandoned : StepFailure::kFailed);
        return;
      }
      step.prepare_for_backward(reducer, {loss});
      loss.backward();
      try {
        step.end_step(&reducer);
        FAIL() << "end_step returned (armed=" << armed << ")";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("smp: dp rank(s) 1 of the dp process group (gloo, "
                                             "rank 0 of 2) could not run step 1"),
                  std::string::npos)
            << e.what();
      }
    });
  }
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr& store) {
    ReplicaStepOptions so;
    so.backward_passes_per_step = 2;
    ReplicaStep step(pg, so);
    step.set_failure_post(store, "test/failed", /*rank=*/r + 4, /*dp_rank=*/r);
    ASSERT_FALSE(step.begin_step());
    if (r == 1) {
      EXPECT_EQ(step.fail_step(nullptr, step.sync_step(), false, "ValueError: bad input"),
                StepFailure::kPosted);
      EXPECT_EQ(step.fail_step(nullptr, true, false, "ValueError: x"), StepFailure::kNothing);
    }
    pg->barrier()->wait();
    EXPECT_EQ(posted_failure(store, "test/failed", {5}, 1),
              "dp rank 1 (rank 5) failed a step that does not reduce and will not reach "
              "reduction 1 (ValueError: bad input)");
    EXPECT_EQ(posted_failure(store, "test/failed", {4}, 1), "");
  });
  run_gloo_world(1, [&](int, const ProcessGroupPtr& pg, const StorePtr&) {
    ReplicaStepOptions so;
    so.reduces = false;
    ReplicaStep step(pg, so);
    EXPECT_EQ(step.fail_step(nullptr, false, false, "E: x"), StepFailure::kNothing);
    EXPECT_EQ(step.fail_step(nullptr, true, true, "E: x"), StepFailure::kNothing);
  });
}

}  // namespace
}  // namespace smp
