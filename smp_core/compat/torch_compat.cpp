#include "smp_core/compat/torch_compat.h"

#include <ATen/autocast_mode.h>

namespace smp::compat {

ProcessGroupPtr make_gloo_group(const StorePtr& store, int rank, int size,
                                std::chrono::milliseconds timeout,
                                const std::string& hostname, const std::string& interface) {
  auto opts = ::c10d::ProcessGroupGloo::Options::create();
  opts->timeout = timeout;
  opts->devices.push_back(
      !interface.empty() ? ::c10d::ProcessGroupGloo::createDeviceForInterface(interface)
      : hostname.empty() ? ::c10d::ProcessGroupGloo::createDefaultDevice()
                         : ::c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
#if SMP_TORCH_AT_LEAST(2, 0)
  auto backend = c10::make_intrusive<::c10d::ProcessGroupGloo>(store, rank, size, opts);
  auto pg = c10::make_intrusive<::c10d::ProcessGroup>(store, rank, size);
  pg->setDefaultBackend(::c10d::ProcessGroup::BackendType::GLOO);
  pg->setBackend(c10::DeviceType::CPU, ::c10d::ProcessGroup::BackendType::GLOO, backend);
#if defined(USE_CUDA)
  pg->setBackend(c10::DeviceType::CUDA, ::c10d::ProcessGroup::BackendType::GLOO, backend);
#endif
  return pg;
#else
  return c10::make_intrusive<::c10d::ProcessGroupGloo>(store, rank, size, opts);
#endif
}

std::string backend_name(const ProcessGroupPtr& pg) { return pg->getBackendName(); }

std::vector<uint8_t> compare_set_and_wake(const StorePtr& store, const std::string& key,
                                          const std::vector<uint8_t>& expected,
                                          const std::vector<uint8_t>& desired) {
  std::vector<uint8_t> now = store->compareSet(key, expected, desired);
  // On torch 2.x compareSet already woke the waiters; the set costs one round trip at
  // init and keeps one code path.
  store->set(key, now);
  return now;
}

#if SMP_TORCH_AT_LEAST(2, 4)
bool autocast_enabled(c10::DeviceType device) { return at::autocast::is_autocast_enabled(device); }
void set_autocast_enabled(c10::DeviceType device, bool enabled) {
  at::autocast::set_autocast_enabled(device, enabled);
}
c10::ScalarType autocast_dtype(c10::DeviceType device) {
  return at::autocast::get_autocast_dtype(device);
}
void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype) {
  at::autocast::set_autocast_dtype(device, dtype);
}
#else
bool autocast_enabled(c10::DeviceType device) {
  return device == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
void set_autocast_enabled(c10::DeviceType device, bool enabled) {
  if (device == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(enabled);
  } else {
    at::autocast::set_enabled(enabled);
  }
}
c10::ScalarType autocast_dtype(c10::DeviceType device) {
  return device == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                        : at::autocast::get_autocast_gpu_dtype();
}
void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype) {
  if (device == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
}
#endif

}  // namespace smp::compat
