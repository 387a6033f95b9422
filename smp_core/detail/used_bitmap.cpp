// See Note [Used bitmap] in used_bitmap.h.
#include "smp_core/detail/used_bitmap.h"

#include <algorithm>

namespace smp::detail {

void UsedBitmap::pack_step(int32_t* slots, const std::vector<char>& used,
                           int64_t late_fires) const {
  std::fill(slots, slots + size(), 0);
  for (size_t i = 0; i < params_; ++i) slots[used_slot(i)] = used[i] ? 1 : 0;
  slots[late_fires_slot()] = static_cast<int32_t>(late_fires);
}

void UsedBitmap::pack_shadow(int32_t* slots, int rank, bool failed) const {
  std::fill(slots, slots + size(), 0);
  if (failed) slots[failed_slot(rank)] = 1;
}

std::vector<int> UsedBitmap::failed_ranks(const int32_t* slots) const {
  std::vector<int> out;
  for (int r = 0; r < world_; ++r)
    if (slots[failed_slot(r)] != 0) out.push_back(r);
  return out;
}

}  // namespace smp::detail
