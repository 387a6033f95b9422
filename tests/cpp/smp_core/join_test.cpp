// JoinProtocol and the reducer under join, over real Gloo ranks (threads,
// tests/cpp/common/gloo_world.h). Closed forms: rank r has r + 1 batches, so at
// iteration k (1-based) n - k + 1 ranks are still active.
#include "smp_core/join.h"
#include "smp_core/join_step.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../common/gloo_world.h"
#include "smp_core/errors.h"
#include "smp_core/reducer.h"

namespace smp {
namespace {

using testing::run_gloo_world;

TEST(JoinProtocol, CountsActiveRanksAndFindsTheLastJoiner) {
  for (int n = 1; n <= 4; ++n) {
    run_gloo_world(n, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
      JoinProtocol join(pg, 5.0);
      int batches = r + 1;
      for (int k = 1; k <= batches; ++k) EXPECT_EQ(join.notify_not_joined(), n - k + 1);
      // The join loop: shadow until nobody is active.
      int64_t k = batches + 1;
      bool last = true;
      for (int64_t active; (active = join.count_not_joined()) != 0; ++k) {
        EXPECT_EQ(active, n - k + 1);
        last = false;
      }
      EXPECT_EQ(k, n + 1);
      EXPECT_EQ(join.iteration(), n + 1);
      EXPECT_EQ(last, r == n - 1);
      EXPECT_EQ(join.find_common_rank(last), n - 1);
      EXPECT_EQ(join.find_common_rank(false), -1);
      EXPECT_EQ(join.check_early_termination(r % 2 == 1), n > 1);
      EXPECT_EQ(join.allreduce_sum(r, "a sum"), n * (n - 1) / 2);
    });
  }
}

// Active ranks reduce r + 1; a joined rank shadows. Averaged over the initial world
// (active_ranks 0) or over the active ranks.
TEST(JoinProtocol, ReducerShadowStepsAndActiveRankDivisor) {
  for (bool shm : {false, true}) {
    for (bool by_active : {false, true}) {
      run_gloo_world(3, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
        std::vector<at::Tensor> ps = {torch::zeros({5}).requires_grad_(),
                                      torch::zeros({3}).requires_grad_()};
        ReducerOptions o;
        o.bucket_cap_bytes = 1;
        o.shared_memory = shm;
        Reducer red(ps, pg, o);
        JoinProtocol join(pg, 5.0);
        const int batches = r + 1;
        for (int k = 1; k <= 3; ++k) {
          if (k > batches) {
            ASSERT_GT(join.count_not_joined(), 0);
            red.run_shadow_step();
            continue;
          }
          int64_t active = join.notify_not_joined();
          red.set_active_ranks(by_active ? static_cast<int>(active) : 0);
          for (auto& p : ps) p.mutable_grad() = at::Tensor();
          at::Tensor loss = (ps[0] * (r + 1)).sum() + (ps[1] * (r + 1)).sum();
          red.prepare_for_backward(true, 1.0, {loss});
          loss.backward();
          red.finalize();
          // Ranks r >= k - 1 are active at iteration k, contributing r + 1 each.
          double sum = 0;
          for (int q = k - 1; q < 3; ++q) sum += q + 1;
          double expect = sum / (by_active ? active : 3);
          for (auto& p : ps)
            EXPECT_NEAR(p.grad().min().item<double>(), expect, 1e-6)
                << "iteration " << k << " shm " << shm << " by_active " << by_active;
        }
        EXPECT_EQ(join.count_not_joined(), 0);
        EXPECT_EQ(red.steps_run(), 3);
      });
    }
  }
}

// Note [Join step]: the model's iteration, decided in C++. Rank r has r + 1 batches;
// the active ranks announce (the reducer divides by the ranks that reduce), a joined
// rank shadows; an evaluation step (announced, no backward) shadows at its end; the
// buffers come from the highest active rank, and at the end every rank takes the last
// joiner's parameters.
TEST(JoinStep, AnnounceShadowEvaluationAndFinalSync) {
  run_gloo_world(3, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    std::vector<at::Tensor> ps = {torch::zeros({4}).requires_grad_()};
    at::Tensor buffer = torch::full({2}, double(r));
    ReducerOptions o;
    o.bucket_cap_bytes = 1;
    Reducer red(ps, pg, o);
    JoinProtocol join(pg, 5.0);
    const int batches = r + 1;
    bool last = true;
    for (int k = 1; k <= 4; ++k) {  // iteration 4 finds every rank joined
      if (k > batches) {
        if (join.count_not_joined() == 0) break;
        last = false;
        join_sync_buffers(join, {buffer}, /*candidate=*/false);
        join_shadow_step(join, red);
        continue;
      }
      join.notify_not_joined();
      join_sync_buffers(join, {buffer}, /*candidate=*/true);
      EXPECT_TRUE(buffer.equal(torch::full({2}, 2.0)));  // rank 2 is always active
      const bool evaluation = (k == 2);  // every active rank evaluates at iteration 2
      EXPECT_TRUE(join_announce_step(join, red, /*sync_step=*/true,
                                     /*divide_by_initial_world_size=*/false));
      if (evaluation) {
        join_end_step(red, /*announced=*/true, /*reduced=*/false);  // shadows the reduction
        continue;
      }
      ps[0].mutable_grad() = at::Tensor();
      at::Tensor loss = (ps[0] * (r + 1)).sum();
      red.prepare_for_backward(true, 1.0, {loss});
      loss.backward();
      red.finalize();
      join_end_step(red, true, true);  // reduced: nothing more
      // Ranks r >= k - 1 are active at iteration k, each r + 1; divided by their count.
      double sum = 0;
      for (int q = k - 1; q < 3; ++q) sum += q + 1;
      EXPECT_NEAR(ps[0].grad().min().item<double>(), sum / (3 - (k - 1)), 1e-6)
          << "rank " << r << " iteration " << k;
      ps[0].data().fill_(double(10 * r + k));  // each rank's own "optimizer step"
    }
    EXPECT_EQ(last, r == 2);
    join_sync_final(join, &red, {ps[0], buffer}, last);
    EXPECT_TRUE(ps[0].equal(torch::full({4}, 23.0)));  // rank 2's value after iteration 3
    EXPECT_EQ(red.steps_run(), 3);  // every rank: 3 reductions, real or shadow
  });
}

TEST(JoinProtocol, SetActiveRanksRejectsBadCounts) {
  run_gloo_world(2, [&](int, const ProcessGroupPtr& pg, const StorePtr&) {
    Reducer red({torch::zeros({2}).requires_grad_()}, pg);
    EXPECT_THROW(red.set_active_ranks(3), ConfigError);
    EXPECT_THROW(red.set_active_ranks(-1), ConfigError);
    EXPECT_THROW(JoinProtocol(pg, 0.0), ConfigError);
  });
}

// Without join, the rank with more batches times out naming the group and the step.
TEST(JoinProtocol, UnevenInputsWithoutJoinTimeOutNamingTheStep) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    std::vector<at::Tensor> ps = {torch::zeros({4}).requires_grad_()};
    ReducerOptions o;
    o.timeout_s = 0.5;
    o.shared_memory = false;
    Reducer red(ps, pg, o);
    auto step = [&] {
      at::Tensor loss = ps[0].sum();
      red.prepare_for_backward(true, 1.0, {loss});
      loss.backward();
      red.finalize();
    };
    step();
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::seconds(2));  // stays, without a step
      return;
    }
    try {
      step();
      FAIL() << "the second step of rank 1 returned";
    } catch (const TimeoutError& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("bucket 0 of 1 (comm hook 'allreduce') on the dp process group (gloo, "
                       "rank 1 of 2) in step 2"),
                std::string::npos) << m;
      EXPECT_NE(m.find("train inside `with model.join():` or `with smp.join.Join([model, "
                       "optimizer]):`"),
              std::string::npos) << m;
    }
  });
}

}  // namespace
}  // namespace smp
