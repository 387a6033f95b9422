// sum_of_squares over many tensors: the double reference to fp32 rounding, any dtype and
// strides, the same bits on any number of threads.
#include "smp_core/optim/norms.h"

#include <gtest/gtest.h>

#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace smp::optim {
namespace {

TEST(Norms, SumOfSquaresOfMixedDtypesAndStrides) {
  std::vector<at::Tensor> ts = {at::randn({(1 << 16) * 3 + 7}), at::randn({0}),
                                at::randn({1000}).to(at::kHalf), at::randn({33}).to(at::kBFloat16),
                                at::randn({40, 30}).t()};
  double want = 0;
  for (const auto& t : ts) want += t.to(at::kDouble).pow(2).sum().item<double>();
  EXPECT_NEAR(sum_of_squares(ts), want, want * 1e-6);
  EXPECT_EQ(sum_of_squares({}), 0.0);
  int threads = at::get_num_threads();
  at::set_num_threads(1);
  double one = sum_of_squares(ts);
  at::set_num_threads(3);
  double many = sum_of_squares(ts);
  at::set_num_threads(threads);
  EXPECT_EQ(one, many);
}

TEST(Norms, OtherDtypesAreRefused) {
  EXPECT_THROW(sum_of_squares({at::zeros({3}, at::kDouble)}), std::runtime_error);
}

}  // namespace
}  // namespace smp::optim
