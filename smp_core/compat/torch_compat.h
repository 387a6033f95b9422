// The one place where torch-version differences live (torch 1.13 from Debian,
// torch 2.x on GPU machines). Everything else calls these helpers.
// Keyed on TORCH_VERSION_MAJOR/MINOR; see docs/architecture.md "Torch versions".
#pragma once

#include <torch/version.h>

#include <chrono>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/autograd/variable.h>

namespace smp::compat {

#define SMP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||      \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// c10d's asynchronous handle: `c10d::ProcessGroup::Work` before 1.13, `c10d::Work` since.
using Work = ::c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;
using ProcessGroupPtr = c10::intrusive_ptr<::c10d::ProcessGroup>;
using StorePtr = c10::intrusive_ptr<::c10d::Store>;

// Creates a Gloo process group over `store` bound to `interface` (a name such as eth0)
// when given, else `hostname`'s interface (empty: the default interface).
// Torch 2.x wraps backends in a ProcessGroup; 1.13's ProcessGroupGloo *is* one.
ProcessGroupPtr make_gloo_group(const StorePtr& store, int rank, int size,
                                std::chrono::milliseconds timeout,
                                const std::string& hostname,
                                const std::string& interface = "");

// The node that accumulates a leaf tensor's gradient, as grad_accumulator() returns it:
// std::shared_ptr<Node> in torch 1.13, c10::intrusive_ptr<Node> in torch 2.x (seen on
// 2.15). Holding it keeps the node (and the hooks on it) alive.
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// A new autograd node of type T, owned the way this torch owns nodes (the same split as
// GradAccumulatorPtr): c10::make_intrusive in torch 2.x, std::shared_ptr in 1.13.
template <class T, class... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...));
  }
}

// store->compareSet(key, expected, desired), then the value it left under `key` set
// again: torch 1.13's TCPStore server does not wake the clients waiting on `key`
// (Store::wait) when a compareSet creates it, so a rank that began waiting before it
// waited out its whole timeout (seen as a hang in smp.init, about one start in ten,
// Note [Job secret]). A set of the same value wakes them on every torch. Returns the
// value now under `key`.
std::vector<uint8_t> compare_set_and_wake(const StorePtr& store, const std::string& key,
                                          const std::vector<uint8_t>& expected,
                                          const std::vector<uint8_t>& desired);

// Name of the backend of `pg` ("gloo", "nccl", ...).
std::string backend_name(const ProcessGroupPtr& pg);

// The calling thread's autocast state for `device` (kCPU or kCUDA), what
// torch.autocast(device) sets: the device-generic functions since torch 2.4 (the
// per-device ones warn there), is_cpu_enabled / get_autocast_gpu_dtype ... before.
bool autocast_enabled(c10::DeviceType device);
void set_autocast_enabled(c10::DeviceType device, bool enabled);
c10::ScalarType autocast_dtype(c10::DeviceType device);
void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype);

}  // namespace smp::compat
