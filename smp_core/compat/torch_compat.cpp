#include "smp_core/compat/torch_compat.h"

namespace smp::compat {

ProcessGroupPtr make_gloo_group(const StorePtr& store, int rank, int size,
                                std::chrono::milliseconds timeout,
                                const std::string& hostname) {
  auto opts = ::c10d::ProcessGroupGloo::Options::create();
  opts->timeout = timeout;
  opts->devices.push_back(hostname.empty()
                              ? ::c10d::ProcessGroupGloo::createDefaultDevice()
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

}  // namespace smp::compat
