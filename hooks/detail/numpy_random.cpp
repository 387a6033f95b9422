#include "hooks/detail/numpy_random.h"

#include "smp_core/errors.h"

namespace smp::hooks::detail {

LegacyRandomState::LegacyRandomState(uint32_t seed) {
  uint32_t s = seed;
  for (int i = 0; i < kMtWords; ++i) {
    key_[i] = s;
    s = 1812433253U * (s ^ (s >> 30)) + static_cast<uint32_t>(i + 1);
  }
  pos_ = kMtWords;
}

uint32_t LegacyRandomState::next_uint32() {
  constexpr int kM = 397;
  constexpr uint32_t kUpper = 0x80000000U, kLower = 0x7fffffffU, kMatrix = 0x9908b0dfU;
  if (pos_ >= kMtWords) {
    int i = 0;
    for (; i < kMtWords - kM; ++i) {
      uint32_t y = (key_[i] & kUpper) | (key_[i + 1] & kLower);
      key_[i] = key_[i + kM] ^ (y >> 1) ^ (-(y & 1U) & kMatrix);
    }
    for (; i < kMtWords - 1; ++i) {
      uint32_t y = (key_[i] & kUpper) | (key_[i + 1] & kLower);
      key_[i] = key_[i + (kM - kMtWords)] ^ (y >> 1) ^ (-(y & 1U) & kMatrix);
    }
    uint32_t y = (key_[kMtWords - 1] & kUpper) | (key_[0] & kLower);
    key_[kMtWords - 1] = key_[kM - 1] ^ (y >> 1) ^ (-(y & 1U) & kMatrix);
    pos_ = 0;
  }
  uint32_t y = key_[pos_++];
  y ^= (y >> 11);
  y ^= (y << 7) & 0x9d2c5680U;
  y ^= (y << 15) & 0xefc60000U;
  y ^= (y >> 18);
  return y;
}

int64_t LegacyRandomState::randint(int64_t high) {
  if (high < 1 || high > (int64_t{1} << 32))
    throw ConfigError(str_cat("smp: randint(high=", high, ") needs 1 <= high <= 2^32"));
  const uint64_t rng = static_cast<uint64_t>(high - 1);
  if (rng == 0) return 0;
  if (rng == 0xffffffffULL) return next_uint32();
  uint64_t mask = rng;
  for (int shift = 1; shift < 64; shift <<= 1) mask |= mask >> shift;
  uint64_t v;
  do v = next_uint32() & mask;
  while (v > rng);
  return static_cast<int64_t>(v);
}

void LegacyRandomState::set_state(const std::vector<uint32_t>& key, int64_t pos) {
  if (key.size() != static_cast<size_t>(kMtWords) || pos < 0 || pos > kMtWords)
    throw ConfigError(str_cat("smp: PowerSGD rng state has ", key.size(), " words and pos=",
                              pos, "; expected 624 words and 0 <= pos <= 624 (numpy "
                              "RandomState.get_state())"));
  for (int i = 0; i < kMtWords; ++i) key_[i] = key[i];
  pos_ = static_cast<int>(pos);
}

}  // namespace smp::hooks::detail
