// XXH3-64 through libxxhash's runtime-dispatched entry points. Internal to
// smp::checkpoint (the include path of xxhash is private to the target).
#pragma once

#include <xxhash.h>
#include <xxh_x86dispatch.h>

#include <cstddef>
#include <cstdint>

namespace smp::checkpoint::detail {

struct Hasher {
  XXH3_state_t* st = XXH3_createState();
  Hasher() { XXH3_64bits_reset(st); }
  ~Hasher() { XXH3_freeState(st); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void reset() { XXH3_64bits_reset(st); }
  // The runtime-dispatched variant picks AVX2/AVX-512 where the CPU has them: ~1.8x
  // the default (SSE2) build of Debian's libxxhash here, the same hash values.
  void update(const void* p, size_t n) { XXH3_64bits_update_dispatch(st, p, n); }
  uint64_t digest() const { return XXH3_64bits_digest(st); }
};

inline uint64_t hash_of(const void* p, size_t n) { return XXH3_64bits_dispatch(p, n); }

}  // namespace smp::checkpoint::detail
