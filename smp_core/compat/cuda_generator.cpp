#include "smp_core/compat/cuda_generator.h"

#include <type_traits>
#include <utility>

#include <ATen/detail/CUDAHooksInterface.h>

namespace smp::compat {
namespace {

// Which name this torch has, by detection rather than a version number: torch 2.x
// added getDefaultGenerator (accelerator hooks) and later dropped the old name.
template <typename Hooks, typename = void>
struct HasOldName : std::false_type {};
template <typename Hooks>
struct HasOldName<Hooks, std::void_t<decltype(std::declval<const Hooks&>().getDefaultCUDAGenerator(
                             c10::DeviceIndex{0}))>> : std::true_type {};

template <typename Hooks>
const at::Generator& generator_of(const Hooks& hooks, c10::DeviceIndex index) {
  if constexpr (HasOldName<Hooks>::value) {
    return hooks.getDefaultCUDAGenerator(index);
  } else {
    return hooks.getDefaultGenerator(index);
  }
}

}  // namespace

const at::Generator& default_cuda_generator(int64_t device) {
  return generator_of(at::detail::getCUDAHooks(), static_cast<c10::DeviceIndex>(device));
}

}  // namespace smp::compat
