// Test helpers for the pipeline engine (smp_core/p2p.h): messages and kind masks.
// Header-only; used by p2p_test.cpp, compute_token_test.cpp and dispatch_helpers.h.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "smp_core/p2p.h"

namespace smp::testing {

constexpr uint32_t bit(int kind) { return 1u << kind; }

inline Message make(int64_t mb, int64_t call, int32_t kind, std::string meta,
                    std::vector<at::Tensor> tensors = {}) {
  Message m;
  m.mb = mb, m.call_id = call, m.kind = kind, m.meta = std::move(meta);
  m.tensors = std::move(tensors);
  return m;
}

}  // namespace smp::testing
