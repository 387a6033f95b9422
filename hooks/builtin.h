// Built-in hooks by type and by name, for bindings and configuration: the closed set
// of hooks smp implements in C++, as c10d's BuiltinCommHookType is torch's. The enum
// and its names are matched here and nowhere else; Python sees the enum as
// smp._C.BuiltinCommHookType and the names on smp._C.BuiltinHook (and in pickles).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "smp_core/comm.h"
#include "smp_core/grad_bucket.h"

namespace smp::hooks {

// Every built-in hook. The name each goes by (builtin_hook_name) is the one
// smp._C.BuiltinHook carries and its pickles store: it never changes.
enum class BuiltinCommHookType : int {
  kAllreduce,            // "allreduce"
  kFp16Compress,         // "fp16_compress"
  kBf16Compress,         // "bf16_compress"
  kNoop,                 // "noop"
  kFp16CompressWrapper,  // "fp16_compress_wrapper": wraps another hook
  kBf16CompressWrapper,  // "bf16_compress_wrapper": wraps another hook
  kPowerSGD,             // "powerSGD"
  kBatchedPowerSGD,      // "batched_powerSGD"
  kQuantizePerTensor,    // "quantization_pertensor"
  kQuantizePerChannel,   // "quantization_perchannel"
};

// Every type, in declaration order.
const std::vector<BuiltinCommHookType>& builtin_hook_types();
// The name of `type` ("powerSGD").
const std::string& builtin_hook_name(BuiltinCommHookType type);
// The type called `name` (case-sensitive). Throws ConfigError naming `name` and the
// allowed names: "smp: built-in hook 'powersgd' is not one of {allreduce, ...}".
BuiltinCommHookType builtin_hook_type(const std::string& name);
// Every name, sorted.
const std::vector<std::string>& builtin_hook_names();

// Whether `type` wraps another hook (needs `inner`): the fp16/bf16 compress wrappers.
bool is_wrapper(BuiltinCommHookType type);
// Whether `name` is a wrapper's name (false for any other string).
bool is_wrapper(const std::string& name);
// Whether `type` is a PowerSGD hook (its state is a PowerSGDState, not a group).
bool is_powersgd(BuiltinCommHookType type);

// The hook of `type` over `state` (null: the reducer's group). Wrappers take `inner`
// and ignore `state`; the others must get no `inner`. kPowerSGD and kBatchedPowerSGD
// get a fresh PowerSGDState with default options over `state` (build one with
// hooks/powersgd.h to choose them). `timeout_s` bounds the waits of hooks that chain
// collectives (PowerSGD, quantization); `channel_size` is quantization_perchannel's
// channel length. Throws ConfigError for a missing or unexpected `inner`.
CommHookPtr make_builtin_hook(BuiltinCommHookType type, ProcessGroupPtr state = {},
                              CommHookPtr inner = nullptr, double timeout_s = 300.0,
                              int64_t channel_size = 512);
// The same by name; an unknown name throws builtin_hook_type's ConfigError.
CommHookPtr make_builtin_hook(const std::string& name, ProcessGroupPtr state = {},
                              CommHookPtr inner = nullptr, double timeout_s = 300.0,
                              int64_t channel_size = 512);

}  // namespace smp::hooks
