// Test helper: runs `n` ranks as threads, each with a real Gloo process group on
// 127.0.0.1 over one shared in-memory store (c10d HashStore). No mocks.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "smp_common/auth.h"
#include "smp_core/compat/torch_compat.h"

namespace smp::testing {

// Note [Job secret]: smp.init sets the process's job key; a test's ranks (threads of
// one process) share one drawn for the test binary.
inline const bool kTestJobKeySet = [] {
  auth::set_job_key(auth::key_from_secret(auth::to_hex(auth::random_bytes(32)), "test"));
  return true;
}();

// Calls fn(rank, pg, store) on n threads; rethrows the first exception of any rank.
inline void run_gloo_world(
    int n, const std::function<void(int, const compat::ProcessGroupPtr&,
                                    const compat::StorePtr&)>& fn,
    std::chrono::milliseconds timeout = std::chrono::milliseconds(10000),
    const std::string& prefix = "test") {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::exception_ptr first;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto pstore = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
        auto pg = compat::make_gloo_group(pstore, r, n, timeout, "127.0.0.1");
        fn(r, pg, store);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace smp::testing
