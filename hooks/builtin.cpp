#include "hooks/builtin.h"

#include <algorithm>
#include <utility>

#include "hooks/debugging_hooks.h"
#include "hooks/default_hooks.h"
#include "hooks/powersgd.h"
#include "hooks/quantization_hooks.h"
#include "smp_core/errors.h"

namespace smp::hooks {
namespace {

using T = BuiltinCommHookType;

// The one table of types and names.
const std::vector<std::pair<T, std::string>>& table() {
  static const std::vector<std::pair<T, std::string>> t = {
      {T::kAllreduce, "allreduce"},
      {T::kFp16Compress, "fp16_compress"},
      {T::kBf16Compress, "bf16_compress"},
      {T::kNoop, "noop"},
      {T::kFp16CompressWrapper, "fp16_compress_wrapper"},
      {T::kBf16CompressWrapper, "bf16_compress_wrapper"},
      {T::kPowerSGD, "powerSGD"},
      {T::kBatchedPowerSGD, "batched_powerSGD"},
      {T::kQuantizePerTensor, "quantization_pertensor"},
      {T::kQuantizePerChannel, "quantization_perchannel"},
  };
  return t;
}

}  // namespace

const std::vector<BuiltinCommHookType>& builtin_hook_types() {
  static const std::vector<T> types = [] {
    std::vector<T> v;
    for (const auto& [type, name] : table()) v.push_back(type);
    return v;
  }();
  return types;
}

const std::string& builtin_hook_name(BuiltinCommHookType type) {
  for (const auto& [t, name] : table())
    if (t == type) return name;
  throw ConfigError(str_cat("smp: BuiltinCommHookType ", static_cast<int>(type),
                            " is not a built-in hook (0..", table().size() - 1, ")"));
}

const std::vector<std::string>& builtin_hook_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& [type, name] : table()) v.push_back(name);
    std::sort(v.begin(), v.end());
    return v;
  }();
  return names;
}

BuiltinCommHookType builtin_hook_type(const std::string& name) {
  for (const auto& [type, n] : table())
    if (n == name) return type;
  std::string allowed;
  for (const auto& n : builtin_hook_names()) allowed += (allowed.empty() ? "" : ", ") + n;
  throw ConfigError("smp: built-in hook '" + name + "' is not one of {" + allowed + "}");
}

bool is_wrapper(BuiltinCommHookType type) {
  return type == T::kFp16CompressWrapper || type == T::kBf16CompressWrapper;
}

bool is_wrapper(const std::string& name) {
  for (const auto& [type, n] : table())
    if (n == name) return is_wrapper(type);
  return false;
}

bool is_powersgd(BuiltinCommHookType type) {
  return type == T::kPowerSGD || type == T::kBatchedPowerSGD;
}

CommHookPtr make_builtin_hook(BuiltinCommHookType type, ProcessGroupPtr state,
                              CommHookPtr inner, double timeout_s, int64_t channel_size) {
  const std::string& name = builtin_hook_name(type);
  if (is_wrapper(type)) {
    if (!inner)
      throw ConfigError("smp: built-in hook '" + name + "' wraps another hook: pass inner=");
  } else if (inner) {
    throw ConfigError("smp: built-in hook '" + name + "' takes no inner hook (only "
                      "fp16_compress_wrapper and bf16_compress_wrapper do)");
  }
  switch (type) {
    case T::kAllreduce:
      return allreduce_hook(std::move(state));
    case T::kFp16Compress:
      return fp16_compress_hook(std::move(state));
    case T::kBf16Compress:
      return bf16_compress_hook(std::move(state));
    case T::kNoop:
      return noop_hook();
    case T::kFp16CompressWrapper:
      return fp16_compress_wrapper(std::move(inner));
    case T::kBf16CompressWrapper:
      return bf16_compress_wrapper(std::move(inner));
    case T::kPowerSGD:
    case T::kBatchedPowerSGD: {
      PowerSGDOptions o;
      o.timeout_s = timeout_s;
      auto st = std::make_shared<PowerSGDState>(o, std::move(state));
      return type == T::kPowerSGD ? powersgd_hook(st) : batched_powersgd_hook(st);
    }
    case T::kQuantizePerTensor:
      return quantization_pertensor_hook(std::move(state), timeout_s);
    case T::kQuantizePerChannel:
      return quantization_perchannel_hook(std::move(state), channel_size, timeout_s);
  }
  throw ConfigError(str_cat("smp: BuiltinCommHookType ", static_cast<int>(type),
                            " is not a built-in hook"));  // unreachable: builtin_hook_name
}

CommHookPtr make_builtin_hook(const std::string& name, ProcessGroupPtr state,
                              CommHookPtr inner, double timeout_s, int64_t channel_size) {
  return make_builtin_hook(builtin_hook_type(name), std::move(state), std::move(inner),
                           timeout_s, channel_size);
}

}  // namespace smp::hooks
