// The slots of the reducer's used bitmap (Note [Used bitmap]). Plain arithmetic on an
// int32 vector, no torch: reducer_test.cpp checks it without processes. Included only
// from .cpp files (the reducer's, its test).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace smp::detail {

// Note [Used bitmap]
// Every synchronized step of the reducer, and every shadow step, ends with ONE
// allreduce (sum) of a small int32 vector over the dp group, after the buckets in the
// same comm queue (Note [Ordered bucket communication]). One collective whatever it
// carries, so that a rank that shadows a step (join) or fails it issues exactly the
// collectives of a real step. Its slots, for n parameters and a group of `world`:
//
//   [0, n)          used: 1 where parameter i had a gradient on this rank this step.
//                   Summed: on how many ranks it had one; 0 = unused everywhere, so
//                   .grad keeps its value (finalize()).
//   n               late fires: accumulator fires after their parameter was copied
//                   into its bucket (Note [Pipeline overlap]). Summed > 0: some rank
//                   saw one, and every rank reduces every bucket again.
//   n+1+r, r<world  failed: 1 if rank r could not run its step (Reducer::fail_step,
//                   Note [Failed rank]). Summed: every other rank raises, naming r.
//
// Shadow steps send zeros except their own failed slot, so a real step's sums are the
// real ranks' alone. Each slot is a count summed over ranks; nothing is bit-packed.
class UsedBitmap {
 public:
  UsedBitmap() = default;
  UsedBitmap(size_t params, int world) : params_(params), world_(world) {}

  // Slots in all: n used, one late-fires, one failed per rank.
  size_t size() const { return params_ + 1 + static_cast<size_t>(world_); }
  size_t used_slot(size_t param) const { return param; }
  size_t late_fires_slot() const { return params_; }
  size_t failed_slot(int rank) const { return params_ + 1 + static_cast<size_t>(rank); }

  // This rank's contribution to a step: `used` flags (one per parameter), the late
  // fires it saw, and no failure. `slots` holds size() entries.
  void pack_step(int32_t* slots, const std::vector<char>& used, int64_t late_fires) const;
  // A shadow step's contribution: zeros, and this rank's failed slot if `failed`.
  void pack_shadow(int32_t* slots, int rank, bool failed) const;
  // Sets this rank's failed slot in a packed contribution (a step abandoned mid-way).
  void mark_failed(int32_t* slots, int rank) const { slots[failed_slot(rank)] = 1; }

  // Read after the sum over the group.
  int32_t used_count(const int32_t* slots, size_t param) const { return slots[used_slot(param)]; }
  int64_t late_fires(const int32_t* slots) const { return slots[late_fires_slot()]; }
  // The ranks that failed their step, ascending.
  std::vector<int> failed_ranks(const int32_t* slots) const;

 private:
  size_t params_ = 0;
  int world_ = 1;
};

}  // namespace smp::detail
