// numpy.random.RandomState's legacy MT19937 and its randint(high), bit-exact. torch's
// PowerSGD hook draws one seed per Q initialisation as
// `torch.manual_seed(np.random.RandomState(random_seed).randint(1_000_000_000))`;
// reproducing the draw in C++ keeps Python off the hot path and gives the same Qs.
// Included only from hooks/*.cpp and tests.
#pragma once

#include <cstdint>
#include <vector>

namespace smp::hooks::detail {

constexpr int kMtWords = 624;

class LegacyRandomState {
 public:
  // numpy's `mt19937_seed` (Knuth's init_genrand); any 32-bit seed.
  explicit LegacyRandomState(uint32_t seed = 0);
  // RandomState.randint(high) for 1 <= high <= 2^32: 32-bit draws masked to the
  // smallest 2^k - 1 >= high - 1, rejected while > high - 1 (numpy's legacy
  // `buffered_bounded_masked_uint32`).
  int64_t randint(int64_t high);
  // genrand_int32.
  uint32_t next_uint32();
  // numpy's get_state()[1] (624 words) and [2] (position, 624 = regenerate next).
  std::vector<uint32_t> key() const { return std::vector<uint32_t>(key_, key_ + kMtWords); }
  int64_t pos() const { return pos_; }
  // Throws ConfigError unless key has 624 words and 0 <= pos <= 624.
  void set_state(const std::vector<uint32_t>& key, int64_t pos);

 private:
  uint32_t key_[kMtWords];
  int pos_;
};

}  // namespace smp::hooks::detail
