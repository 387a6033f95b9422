// PowerSGD hooks over real Gloo ranks (threads). Closed forms: a full-rank
// approximation of a matrix with full column rank returns the exact average; rank-1
// gradients that share one direction are averaged exactly at rank 1. The numpy random
// sequence is checked against values printed by numpy 1.24.
#include "hooks/powersgd.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../common/gloo_world.h"
#include "hooks/detail/numpy_random.h"
#include "hooks/detail/powersgd_math.h"
#include "smp_core/errors.h"
#include "smp_core/reducer.h"

namespace smp::hooks {
namespace {

using smp::testing::run_gloo_world;

// A bucket holding `shapes`, filled with `fill(j)` for tensor j.
std::shared_ptr<GradBucket> make_bucket(size_t index, size_t count,
                                        const std::vector<std::vector<int64_t>>& shapes,
                                        const std::function<at::Tensor(size_t)>& fill,
                                        const ProcessGroupPtr& pg, bool shadow = false) {
  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;
  int64_t n = 0;
  for (const auto& s : shapes) {
    params.push_back(torch::zeros(s));
    offsets.push_back(n);
    n += params.back().numel();
  }
  at::Tensor buf = torch::zeros({n});
  for (size_t j = 0; j < shapes.size(); ++j)
    buf.narrow(0, offsets[j], params[j].numel()).copy_(fill(j).reshape({-1}));
  return std::make_shared<GradBucket>(index, count, buf, params, offsets, pg, shadow);
}

// Runs one bucket through `hook` as the reducer does; returns the reduced tensor.
at::Tensor reduce(const CommHookPtr& hook, GradBucket& b) {
  FuturePtr f = hook->run(b);
  wait_future(f, 10, "test bucket");
  return hook->result(b, f->value());
}

PowerSGDOptions opts(int64_t rank, int64_t start = 2, double rate = 2) {
  PowerSGDOptions o;
  o.matrix_approximation_rank = rank;
  o.start_powerSGD_iter = start;
  o.min_compression_rate = rate;
  o.timeout_s = 10;
  return o;
}

TEST(NumpyRandom, MatchesLegacyRandomState) {
  detail::LegacyRandomState r0(0), r42(42), rmax(4294967295U);
  for (int64_t want : {209652396, 398764591, 924231285, 404868288, 441365315})
    EXPECT_EQ(r0.randint(1000000000), want);
  for (int64_t want : {534895718, 199900595, 862061404, 787846414, 996406378})
    EXPECT_EQ(r42.randint(1000000000), want);
  for (int64_t want : {419326371, 479346978, 697429004, 269265991, 167655348})
    EXPECT_EQ(rmax.randint(1000000000), want);
  // Past several regenerations of the 624-word state.
  detail::LegacyRandomState r(0);
  int64_t sum = 0, last = 0;
  for (int i = 0; i < 2000; ++i) sum += last = r.randint(1000000000);
  EXPECT_EQ(sum, 1036115415022);
  EXPECT_EQ(last, 2852784);
  detail::LegacyRandomState r7(7);
  for (int64_t want : {4, 1, 3, 3, 4, 1, 0, 1}) EXPECT_EQ(r7.randint(5), want);
  EXPECT_EQ(r7.randint(int64_t{1} << 32), 309457262);
  // State round trip continues the sequence.
  detail::LegacyRandomState a(3), b(0);
  a.randint(10);
  b.set_state(a.key(), a.pos());
  for (int i = 0; i < 700; ++i) ASSERT_EQ(a.next_uint32(), b.next_uint32());
  EXPECT_THROW(b.set_state({1, 2}, 0), ConfigError);
}

TEST(PowerSGDMath, OrthogonalizeAndCompressRule) {
  torch::manual_seed(1);
  for (int64_t r : {1, 2, 4}) {  // Gram-Schmidt for r <= 2, QR above
    at::Tensor m = torch::randn({3, 9, r});
    detail::orthogonalize(m, 0);
    at::Tensor gram = at::bmm(m.transpose(1, 2), m);
    EXPECT_TRUE(torch::allclose(gram, torch::eye(r).expand({3, r, r}), 1e-5, 1e-5)) << r;
  }
  at::Tensor z = torch::zeros({1, 4, 1});
  detail::orthogonalize(z, 1e-8);
  EXPECT_EQ(z.abs().sum().item<float>(), 0.f);  // epsilon keeps a zero column finite
  EXPECT_TRUE(detail::should_compress(16, 16, 1, 2));     // 64 < 256
  EXPECT_FALSE(detail::should_compress(100, 1, 1, 2));    // a bias: 202 >= 100
  EXPECT_FALSE(detail::should_compress(4, 4, 2, 1));      // 16 == 16 is not <
}

TEST(PowerSGD, OptionErrorsNameTheArgument) {
  try {
    PowerSGDState s(opts(0));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "smp: PowerSGDState matrix_approximation_rank=0 must be >= 1");
  }
  try {
    PowerSGDState s(opts(1, 1));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("smp: PowerSGDState start_powerSGD_iter=1 must be > 1 "
                                          "when use_error_feedback or warm_start is on", 0), 0u);
  }
  PowerSGDOptions o = opts(1, 0);
  o.use_error_feedback = o.warm_start = false;
  EXPECT_NO_THROW(PowerSGDState{o});
}

// Vanilla averaging until start_powerSGD_iter; then rank-1 gradients that share one
// direction come out as their exact average, and the stats count what was sent.
TEST(PowerSGD, VanillaThenExactOnRankOneGradients) {
  for (int n : {1, 2, 3}) {
    run_gloo_world(n, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
      auto st = std::make_shared<PowerSGDState>(opts(1, 3), pg);
      auto hook = powersgd_hook(st);
      at::Tensor u = torch::linspace(1, 2, 16).view({16, 1}), v = torch::linspace(-1, 1, 12).view({1, 12});
      const double scale = r + 1, mean = (n + 1) / 2.0;
      // A 16x12 matrix (compressed: 28 * 2 < 192) and a bias of 16 (not compressed).
      std::vector<std::vector<int64_t>> shapes{{16, 12}, {16}};
      auto fill = [&](size_t j) {
        return j == 0 ? (u * v * scale) : torch::full({16}, 0.5 * scale);
      };
      for (int step = 0; step < 6; ++step) {
        int64_t bytes0 = st->bytes_allreduced();
        auto b = make_bucket(0, 1, shapes, fill, pg);
        at::Tensor out = reduce(hook, *b);
        auto g = b->gradients();  // views of the result
        EXPECT_EQ(out.data_ptr(), b->buffer().data_ptr());
        EXPECT_TRUE(torch::allclose(g[0], u * v * mean, 1e-4, 1e-5)) << "step " << step << " rank " << r;
        EXPECT_TRUE(torch::allclose(g[1], torch::full({16}, 0.5 * mean), 1e-6, 1e-6));
        EXPECT_EQ(st->iter(), step + 1);
        int64_t sent = st->bytes_allreduced() - bytes0;
        EXPECT_EQ(sent, step < 3 ? (192 + 16) * 4 : (16 + 12 + 16) * 4) << step;
      }
      auto [rate, before, after] = st->compression_stats();
      EXPECT_EQ(before, 3 * (192 + 16));
      EXPECT_EQ(after, 3 * (16 + 12 + 16));
      EXPECT_DOUBLE_EQ(rate, 208.0 / 44.0);
    });
  }
}

// With rank = min(n, m) and min_compression_rate 0 every matrix is compressed and the
// approximation is the exact average (QR for rank > 2, Gram-Schmidt otherwise); both
// hooks, warm start on and off, batching of same shapes on and off.
TEST(PowerSGD, FullRankIsExactAverage) {
  torch::manual_seed(5);
  std::vector<at::Tensor> data;  // per rank, drawn up front so threads agree
  for (int r = 0; r < 3; ++r) data.push_back(torch::randn({3, 8, 4}));
  for (bool batched : {false, true})
    for (bool warm : {true, false})
      for (bool same : {false, true}) {
        run_gloo_world(3, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
          PowerSGDOptions o = opts(batched ? 6 : 4, 2, 0);
          o.warm_start = warm;
          o.use_error_feedback = warm;
          o.batch_tensors_with_same_shape = same;
          auto st = std::make_shared<PowerSGDState>(o, pg);
          auto hook = batched ? batched_powersgd_hook(st) : powersgd_hook(st);
          // Three 8x4 matrices (batched: 96 elements, side 10, rank 6 < 10: not exact,
          // so the batched hook gets one 6x6 matrix instead: 36 elements, rank 6).
          std::vector<std::vector<int64_t>> shapes =
              batched ? std::vector<std::vector<int64_t>>{{6, 6}}
                      : std::vector<std::vector<int64_t>>{{8, 4}, {8, 4}, {8, 4}};
          auto fill = [&](size_t j) {
            return batched ? data[r].view({-1}).narrow(0, 0, 36) : data[r][j];
          };
          at::Tensor want = batched ? (data[0] + data[1] + data[2]).view({-1}).narrow(0, 0, 36) / 3
                                    : ((data[0] + data[1] + data[2]) / 3).view({-1});
          for (int step = 0; step < 4; ++step) {
            auto b = make_bucket(0, 1, shapes, fill, pg);
            at::Tensor out = reduce(hook, *b);
            // Error feedback adds the previous (rounding-sized) error: still the average.
            EXPECT_TRUE(torch::allclose(out, want, 1e-4, 1e-4))
                << "batched " << batched << " warm " << warm << " same " << same << " step "
                << step << " max err " << (out - want).abs().max().item<float>();
          }
        });
      }
}

// Error feedback: the state keeps input - output; next step adds it back.
TEST(PowerSGD, ErrorFeedbackKeepsWhatCompressionLost) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    auto st = std::make_shared<PowerSGDState>(opts(1, 2), pg);
    auto hook = powersgd_hook(st);
    torch::manual_seed(11 + r);
    at::Tensor g = torch::randn({12, 10});
    for (int step = 0; step < 4; ++step) {
      auto b = make_bucket(0, 1, {{12, 10}}, [&](size_t) { return g; }, pg);
      at::Tensor prev = step >= 3 ? st->snapshot().error_dict.at(0).clone() : at::Tensor();
      at::Tensor out = reduce(hook, *b).clone();
      if (step < 2) {
        EXPECT_TRUE(st->snapshot().error_dict.empty());
        continue;
      }
      at::Tensor in = g.reshape({-1}) + (prev.defined() ? prev : torch::zeros({120}));
      EXPECT_TRUE(torch::allclose(st->snapshot().error_dict.at(0), in - out, 1e-5, 1e-6)) << step;
    }
  });
}

// Save mid-training into a fresh state: both continue bit for bit, random draws too.
TEST(PowerSGD, SnapshotRestoreContinuesExactly) {
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    PowerSGDOptions o = opts(2, 2, 0.5);
    o.warm_start = false;  // a fresh random Q every step: the RNG state matters
    auto a = std::make_shared<PowerSGDState>(o, pg);
    auto ha = powersgd_hook(a);
    torch::manual_seed(3 + r);
    std::vector<at::Tensor> grads;
    for (int s = 0; s < 8; ++s) grads.push_back(torch::randn({20, 6}));
    std::vector<std::vector<int64_t>> shapes{{10, 6}, {10, 6}};
    auto step = [&](const CommHookPtr& h, int s) {
      auto b = make_bucket(0, 1, shapes, [&](size_t j) { return grads[s].narrow(0, 10 * j, 10); }, pg);
      return reduce(h, *b).clone();
    };
    for (int s = 0; s < 4; ++s) step(ha, s);
    auto bst = std::make_shared<PowerSGDState>(opts(1, 900), pg);
    bst->restore(a->snapshot());
    auto hb = powersgd_hook(bst);
    for (int s = 4; s < 8; ++s) {
      at::Tensor x = step(ha, s), y = step(hb, s);
      EXPECT_TRUE(torch::equal(x, y)) << "step " << s;
    }
    EXPECT_EQ(a->iter(), bst->iter());
    EXPECT_EQ(a->compression_stats(), bst->compression_stats());
  });
}

// Many buckets, several ranks, through the Reducer: the per-bucket chains (rest, P, Q)
// keep one order on every rank, so Gloo never mismatches; replicas agree bit for bit.
// A shadow step on one rank issues the same chain.
TEST(PowerSGD, ManyBucketsThroughTheReducerWithShadowSteps) {
  for (bool batched : {false, true}) {
    std::vector<at::Tensor> finals(3);
    run_gloo_world(3, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
      std::vector<at::Tensor> ps;
      for (int i = 0; i < 40; ++i)
        ps.push_back(torch::zeros(i % 2 ? std::vector<int64_t>{24, 16} : std::vector<int64_t>{16})
                         .requires_grad_());
      ReducerOptions ro;
      ro.bucket_cap_bytes = 1;  // one tensor per bucket
      ro.timeout_s = 10;
      Reducer red(ps, pg, ro);
      auto st = std::make_shared<PowerSGDState>(opts(1, 2), pg);
      red.register_comm_hook(batched ? batched_powersgd_hook(st) : powersgd_hook(st));
      torch::manual_seed(100 + r);
      for (int s = 0; s < 6; ++s) {
        if (s == 4 && r == 1) {  // joined: no data this step
          red.run_shadow_step();
          continue;
        }
        at::Tensor loss = torch::zeros({});
        for (auto& p : ps) loss = loss + (p * torch::randn(p.sizes())).sum();
        red.prepare_for_backward(true, 1.0, {loss});
        loss.backward();
        red.finalize();
        for (auto& p : ps) p.mutable_grad().zero_();
      }
      EXPECT_EQ(st->iter(), 6);
      std::vector<at::Tensor> gs;
      for (auto& p : ps) gs.push_back(p.grad().reshape({-1}));
      finals[r] = at::cat(gs);
    });
    EXPECT_TRUE(torch::equal(finals[0], finals[1]));
    EXPECT_TRUE(torch::equal(finals[0], finals[2]));
  }
}

TEST(PowerSGD, NonFloatGradientsAreRefused) {
  run_gloo_world(1, [&](int, const ProcessGroupPtr& pg, const StorePtr&) {
    auto hook = powersgd_hook(std::make_shared<PowerSGDState>(opts(1), pg));
    at::Tensor buf = torch::zeros({4}, at::kInt);
    GradBucket b(0, 1, buf, {torch::zeros({4}, at::kInt)}, {0}, pg);
    try {
      hook->run(b);
      FAIL();
    } catch (const ConfigError& e) {
      EXPECT_STREQ(e.what(), "smp: powerSGD_hook: bucket 0 holds Int gradients; PowerSGD "
                             "compresses only floating-point gradients (float32, float64, "
                             "float16, bfloat16)");
    }
  });
}

}  // namespace
}  // namespace smp::hooks
