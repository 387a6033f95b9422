// Built-in hooks by name, for bindings and configuration: the names Python's
// smp._C.BuiltinHook carries.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "smp_core/comm.h"
#include "smp_core/grad_bucket.h"

namespace smp::hooks {

// "allreduce", "fp16_compress", "bf16_compress", "noop", "fp16_compress_wrapper",
// "bf16_compress_wrapper", "powerSGD", "batched_powerSGD", "quantization_pertensor",
// "quantization_perchannel" (sorted).
const std::vector<std::string>& builtin_hook_names();

// Whether `name` is a wrapper (needs `inner`).
bool is_wrapper(const std::string& name);

// The hook called `name` over `state` (null: the reducer's group). Wrappers take
// `inner` and ignore `state`; the others must get no `inner`. "powerSGD" and
// "batched_powerSGD" get a fresh PowerSGDState with default options over `state`
// (build one with hooks/powersgd.h to choose them). `timeout_s` bounds the waits of
// hooks that chain collectives (PowerSGD, quantization); `channel_size` is
// quantization_perchannel's channel length. Throws ConfigError naming the allowed names.
CommHookPtr make_builtin_hook(const std::string& name, ProcessGroupPtr state = {},
                              CommHookPtr inner = nullptr, double timeout_s = 300.0,
                              int64_t channel_size = 512);

}  // namespace smp::hooks
