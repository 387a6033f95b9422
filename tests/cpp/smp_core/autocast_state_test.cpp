#include "smp_core/autocast_state.h"

#include <gtest/gtest.h>

#include <thread>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include "smp_core/compat/torch_compat.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

constexpr c10::DeviceType kCpu = c10::DeviceType::CPU, kCuda = c10::DeviceType::CUDA;

// The calling thread as `with torch.autocast("cpu", dtype)` leaves it inside the block.
struct CpuAutocast {
  explicit CpuAutocast(at::ScalarType dtype) {
    compat::set_autocast_enabled(kCpu, true);
    compat::set_autocast_dtype(kCpu, dtype);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    compat::set_autocast_enabled(kCpu, false);
    compat::set_autocast_dtype(kCpu, at::kBFloat16);
  }
};

// Note [Autocast travels]: a thread's default is 0; a captured state installed on
// another thread makes its ops autocast as on the first, and goes when the scope does.
TEST(AutocastState, CapturedOnOneThreadRunsAsThereOnAnother) {
  EXPECT_EQ(autocast_state::capture(), 0);
  int64_t word = 0;
  {
    CpuAutocast on(at::kBFloat16);
    word = autocast_state::capture();
  }
  EXPECT_NE(word, 0);
  EXPECT_EQ(autocast_state::capture(), 0);  // the block is over here
  std::thread([word] {
    const at::Tensor a = at::randn({4, 4}), b = at::randn({4, 4});
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
    {
      const autocast_state::Scope scope(word);
      EXPECT_EQ(autocast_state::capture(), word);
      EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16);
    }
    EXPECT_EQ(autocast_state::capture(), 0);
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
  }).join();
}

// A request without autocast on a thread inside autocast (a nested call served by a
// task that waits under autocast) runs without it; the thread's own state comes back.
TEST(AutocastState, OffIsInstalledTooAndTheOuterStateComesBack) {
  CpuAutocast on(at::kBFloat16);
  const int64_t outer = autocast_state::capture();
  const at::Tensor w = at::randn({4, 4}).requires_grad_(), x = at::randn({4, 4});
  EXPECT_EQ(at::mm(x, w).scalar_type(), at::kBFloat16);  // caches w's cast
  {
    const autocast_state::Scope scope(0);
    EXPECT_FALSE(compat::autocast_enabled(kCpu));
    EXPECT_EQ(at::mm(x, w).scalar_type(), at::kFloat);
  }
  EXPECT_EQ(autocast_state::capture(), outer);
  EXPECT_EQ(compat::autocast_dtype(kCpu), at::kBFloat16);
  EXPECT_EQ(at::mm(x, w).scalar_type(), at::kBFloat16);
}

// Each device's dtype and the cache flag are part of the state.
TEST(AutocastState, DtypesAndTheCacheFlagAreTheState) {
  int64_t half = 0, no_cache = 0, cuda = 0;
  {
    CpuAutocast on(at::kHalf);
    half = autocast_state::capture();
    at::autocast::set_autocast_cache_enabled(false);
    no_cache = autocast_state::capture();
    at::autocast::set_autocast_cache_enabled(true);
  }
  compat::set_autocast_enabled(kCuda, true);
  cuda = autocast_state::capture();
  compat::set_autocast_enabled(kCuda, false);
  EXPECT_NE(half, no_cache);
  EXPECT_NE(half, cuda);
  std::thread([=] {
    {
      const autocast_state::Scope scope(half);
      EXPECT_EQ(compat::autocast_dtype(kCpu), at::kHalf);
      EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
    }
    {
      const autocast_state::Scope scope(no_cache);
      EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
    }
    EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
    {
      const autocast_state::Scope scope(cuda);
      EXPECT_TRUE(compat::autocast_enabled(kCuda));
      EXPECT_FALSE(compat::autocast_enabled(kCpu));
    }
    EXPECT_FALSE(compat::autocast_enabled(kCuda));
    EXPECT_EQ(compat::autocast_dtype(kCpu), at::kBFloat16);
  }).join();
}

// A word no capture() makes (a peer's malformed header) never reaches torch.
TEST(AutocastState, MalformedWordsAreRefused) {
  const int64_t int_dtype = 1 | (int64_t{static_cast<int>(at::kInt)} << 8);
  for (int64_t word : {int64_t{1} << 40, int64_t{4}, int64_t{0x0f00}, int_dtype, int64_t{0xff01}}) {
    EXPECT_THROW(autocast_state::Scope scope(word), CommError) << std::hex << word;
    EXPECT_EQ(autocast_state::capture(), 0);
  }
}

}  // namespace
}  // namespace smp
