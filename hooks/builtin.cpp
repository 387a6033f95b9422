#include "hooks/builtin.h"

#include "hooks/debugging_hooks.h"
#include "hooks/default_hooks.h"
#include "hooks/powersgd.h"
#include "hooks/quantization_hooks.h"
#include "smp_core/errors.h"

namespace smp::hooks {

const std::vector<std::string>& builtin_hook_names() {
  static const std::vector<std::string> names = {
      "allreduce",     "batched_powerSGD",      "bf16_compress", "bf16_compress_wrapper",
      "fp16_compress", "fp16_compress_wrapper", "noop",          "powerSGD",
      "quantization_perchannel", "quantization_pertensor"};
  return names;
}

bool is_wrapper(const std::string& name) {
  return name == "fp16_compress_wrapper" || name == "bf16_compress_wrapper";
}

CommHookPtr make_builtin_hook(const std::string& name, ProcessGroupPtr state,
                              CommHookPtr inner, double timeout_s, int64_t channel_size) {
  if (is_wrapper(name)) {
    if (!inner)
      throw ConfigError("smp: built-in hook '" + name + "' wraps another hook: pass inner=");
    return name[0] == 'f' ? fp16_compress_wrapper(std::move(inner))
                          : bf16_compress_wrapper(std::move(inner));
  }
  if (inner)
    throw ConfigError("smp: built-in hook '" + name + "' takes no inner hook (only "
                      "fp16_compress_wrapper and bf16_compress_wrapper do)");
  if (name == "allreduce") return allreduce_hook(std::move(state));
  if (name == "fp16_compress") return fp16_compress_hook(std::move(state));
  if (name == "bf16_compress") return bf16_compress_hook(std::move(state));
  if (name == "noop") return noop_hook();
  if (name == "quantization_pertensor")
    return quantization_pertensor_hook(std::move(state), timeout_s);
  if (name == "quantization_perchannel")
    return quantization_perchannel_hook(std::move(state), channel_size, timeout_s);
  if (name == "powerSGD" || name == "batched_powerSGD") {
    PowerSGDOptions o;
    o.timeout_s = timeout_s;
    auto st = std::make_shared<PowerSGDState>(o, std::move(state));
    return name == "powerSGD" ? powersgd_hook(st) : batched_powersgd_hook(st);
  }
  std::string allowed;
  for (const auto& n : builtin_hook_names()) allowed += (allowed.empty() ? "" : ", ") + n;
  throw ConfigError("smp: built-in hook '" + name + "' is not one of {" + allowed + "}");
}

}  // namespace smp::hooks
