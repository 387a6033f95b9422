// FNV-1a, 64 bits: the fingerprint ranks compare to agree (a resolved config, a
// partition plan). Not for security (smp_common/auth.h signs) nor for checkpoints'
// integrity (xxhash there). Header-only: torch-free, no library needed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace smp::common {

constexpr uint64_t kFnvOffset = 14695981039346656037ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;

// Continues the hash `h` over `len` bytes at `data`.
inline uint64_t fnv1a(uint64_t h, const void* data, size_t len) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < len; ++i) {
    h ^= p[i];
    h *= kFnvPrime;
  }
  return h;
}

inline uint64_t fnv1a(const std::string& s) { return fnv1a(kFnvOffset, s.data(), s.size()); }

}  // namespace smp::common
