#include "smp_core/autocast_state.h"

#include <ATen/autocast_mode.h>

#include "smp_core/compat/torch_compat.h"
#include "smp_core/errors.h"

namespace smp::autocast_state {
namespace {

// The word (Note [Autocast travels]): bit 0 cpu on, bit 1 cuda on, bit 2 the cast
// cache off; an enabled device's dtype (a c10::ScalarType) in byte 1 (cpu) or 2 (cuda).
constexpr int64_t kCpuOn = 1, kCudaOn = 2, kNoCache = 4;
constexpr int kCpuShift = 8, kCudaShift = 16;
constexpr int64_t kKnown = kCpuOn | kCudaOn | kNoCache | (int64_t{0xff} << kCpuShift) |
                           (int64_t{0xff} << kCudaShift);

constexpr c10::DeviceType kCpu = c10::DeviceType::CPU, kCuda = c10::DeviceType::CUDA;

int64_t dtype_of(int64_t word, int shift) { return (word >> shift) & 0xff; }

// Throws unless `word` is one capture() can make: a peer's malformed header must not
// reach torch as a dtype.
void check(int64_t word) {
  auto bad = [word](const char* why) {
    return CommError(str_cat("smp: pipeline protocol error: a request's autocast state 0x",
                             std::hex, word, " ", why, " (Note [Autocast travels])"));
  };
  if (word & ~kKnown) throw bad("has unknown bits");
  const int64_t on = word & (kCpuOn | kCudaOn);
  if (on == 0 && word != 0) throw bad("is off with other bits set");
  for (auto [bit, shift] : {std::pair{kCpuOn, kCpuShift}, std::pair{kCudaOn, kCudaShift}}) {
    const int64_t dtype = dtype_of(word, shift);
    if (!(word & bit)) {
      if (dtype != 0) throw bad("names the dtype of a device it leaves off");
      continue;
    }
    if (dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions) ||
        !c10::isFloatingType(static_cast<c10::ScalarType>(dtype)))
      throw bad("names a dtype that is no floating-point type");
  }
}

}  // namespace

int64_t capture() {
  const bool cpu = compat::autocast_enabled(kCpu), cuda = compat::autocast_enabled(kCuda);
  if (!cpu && !cuda) return 0;
  int64_t word = 0;
  if (cpu)
    word |= kCpuOn | static_cast<int64_t>(compat::autocast_dtype(kCpu)) << kCpuShift;
  if (cuda)
    word |= kCudaOn | static_cast<int64_t>(compat::autocast_dtype(kCuda)) << kCudaShift;
  if (!at::autocast::is_autocast_cache_enabled()) word |= kNoCache;
  return word;
}

Scope::Scope(int64_t word) {
  if (capture() == word) return;
  check(word);
  saved_[0] = compat::autocast_enabled(kCpu);
  saved_[1] = static_cast<int64_t>(compat::autocast_dtype(kCpu));
  saved_[2] = compat::autocast_enabled(kCuda);
  saved_[3] = static_cast<int64_t>(compat::autocast_dtype(kCuda));
  saved_[4] = at::autocast::is_autocast_cache_enabled();
  // As torch.autocast.__enter__: the flags, then one level of nesting.
  compat::set_autocast_enabled(kCpu, word & kCpuOn);
  if (word & kCpuOn)
    compat::set_autocast_dtype(kCpu, static_cast<c10::ScalarType>(dtype_of(word, kCpuShift)));
  compat::set_autocast_enabled(kCuda, word & kCudaOn);
  if (word & kCudaOn)
    compat::set_autocast_dtype(kCuda, static_cast<c10::ScalarType>(dtype_of(word, kCudaShift)));
  if (word != 0) at::autocast::set_autocast_cache_enabled(!(word & kNoCache));
  at::autocast::increment_nesting();
  changed_ = true;
}

Scope::~Scope() {
  if (!changed_) return;
  // As torch.autocast.__exit__: the outermost exit drops the cast weights.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(kCpu, saved_[0] != 0);
  compat::set_autocast_dtype(kCpu, static_cast<c10::ScalarType>(saved_[1]));
  compat::set_autocast_enabled(kCuda, saved_[2] != 0);
  compat::set_autocast_dtype(kCuda, static_cast<c10::ScalarType>(saved_[3]));
  at::autocast::set_autocast_cache_enabled(saved_[4] != 0);
}

}  // namespace smp::autocast_state
