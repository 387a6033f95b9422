// Building the reducer (smp_core/detail/reducer_build.cpp) over real Gloo ranks
// (threads, tests/cpp/common/gloo_world.h): the checks every rank makes against the
// others, the bucket layout with and without owners, and gradients that become views
// of their buckets. The reducer's steps are tested in reducer_test.cpp.
#include "smp_core/reducer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <string>
#include <vector>

#include "../common/gloo_world.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

using testing::run_gloo_world;
using Shapes = std::vector<std::vector<int64_t>>;

std::vector<at::Tensor> make_params(const Shapes& shapes) {
  std::vector<at::Tensor> ps;
  for (const auto& s : shapes) ps.push_back(torch::randn(s).requires_grad_());
  return ps;
}

// Whether building a reducer of `ps` raised a CommError on this rank; expects one with
// `message`.
bool build_raises(const std::vector<at::Tensor>& ps, const ProcessGroupPtr& pg, int r,
                  const char* message) {
  try {
    Reducer red(ps, pg);
    ADD_FAILURE() << "rank " << r << " built a reducer";
    return false;
  } catch (const CommError& e) {
    EXPECT_STREQ(e.what(), message);
    return true;
  }
}

TEST(ReducerBuild, ShapeMismatchThrowsOnEveryRank) {
  std::atomic<int> raised{0};
  run_gloo_world(3, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    Shapes shapes = {{2}, {4, 8}, {3}};
    if (r == 2) shapes[1] = {4, 9};
    if (build_raises(make_params(shapes), pg, r,
                     "smp: Reducer: parameter 1 is Float[4, 8] on dp rank 0 but Float[4, 9] on "
                     "dp rank 2 (every rank must pass the same parameters in the same order)"))
      ++raised;
  });
  EXPECT_EQ(raised.load(), 3);
  run_gloo_world(2, [&](int r, const ProcessGroupPtr& pg, const StorePtr&) {
    build_raises(make_params(r == 0 ? Shapes{{2}, {3}} : Shapes{{2}}), pg, r,
                 "smp: Reducer: dp rank 0 has 2 parameters but dp rank 1 has 1 (every rank "
                 "must pass the same parameters in the same order)");
  });
}

TEST(ReducerBuild, RejectsBadParameters) {
  run_gloo_world(1, [&](int, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{2}});
    EXPECT_THROW(Reducer({ps[0], ps[0]}, pg), ConfigError);
    EXPECT_THROW(Reducer({torch::ones({2})}, pg), ConfigError);
    ReducerOptions o;
    o.expected_order = {1};
    EXPECT_THROW(Reducer(ps, pg, o), ConfigError);
  });
}

// Buckets follow the caps in reverse registration order (the first closes at >= 500
// bytes, the rest at >= 1000; each parameter is 400); with owners, each bucket is laid
// out owner by owner (ranks in order, every-rank parameters last), stable within one.
TEST(ReducerBuild, BucketsFollowTheCapsAndOwnersGroupEachBucket) {
  run_gloo_world(2, [&](int, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{100}, {100}, {100}, {100}, {100}});
    ReducerOptions o;
    o.bucket_cap_bytes = 1000;
    o.first_bucket_bytes = 500;
    o.shared_memory = false;
    Reducer red(ps, pg, o);
    EXPECT_EQ(red.bucket_indices(), (std::vector<std::vector<int64_t>>{{4, 3}, {2, 1, 0}}));
    EXPECT_EQ(red.num_params(), 5u);

    ReducerOptions owned;
    owned.shared_memory = false;
    owned.owners = {1, 0, 1, 0, -1};
    Reducer sharded(ps, pg, owned);
    EXPECT_EQ(sharded.bucket_indices(), (std::vector<std::vector<int64_t>>{{3, 1, 2, 0, 4}}));
  });
}

// gradient_as_bucket_view: a gradient defined before the reducer is built keeps its
// values and becomes an alias of its slice of the bucket (one storage for the bucket).
TEST(ReducerBuild, GradientsBecomeViewsOfTheirBucket) {
  run_gloo_world(1, [&](int, const ProcessGroupPtr& pg, const StorePtr&) {
    auto ps = make_params({{3}, {2, 2}});
    ps[0].mutable_grad() = torch::full({3}, 7.f);
    ReducerOptions o;
    o.gradient_as_bucket_view = true;
    o.shared_memory = false;
    Reducer red(ps, pg, o);
    ASSERT_EQ(red.bucket_indices(), (std::vector<std::vector<int64_t>>{{1, 0}}));
    EXPECT_TRUE(ps[0].grad().equal(torch::full({3}, 7.f)));
    EXPECT_FALSE(ps[1].grad().defined());  // stays None until it is ready
    // The bucket's storage: parameter 1's 4 floats, then parameter 0's 3.
    EXPECT_EQ(ps[0].grad().storage_offset(), 4);
    EXPECT_EQ(ps[0].grad().storage().nbytes(), 7 * sizeof(float));
  });
}

}  // namespace
}  // namespace smp
