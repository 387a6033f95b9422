// hooks/builtin: the closed set of built-in hooks as an enum, and its one name table.
// No processes: conversions and errors only (the hooks themselves run in
// default_hooks_test.cpp and powersgd_test.cpp).
#include "hooks/builtin.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "hooks/default_hooks.h"
#include "smp_core/errors.h"

namespace smp::hooks {
namespace {

using T = BuiltinCommHookType;

TEST(BuiltinCommHookType, EveryTypeRoundTripsThroughItsName) {
  const auto& types = builtin_hook_types();
  ASSERT_EQ(types.size(), 10u);
  std::set<std::string> names;
  for (T t : types) {
    const std::string& name = builtin_hook_name(t);
    EXPECT_EQ(builtin_hook_type(name), t) << name;
    names.insert(name);
  }
  // Names are distinct, and builtin_hook_names() lists exactly them, sorted.
  EXPECT_EQ(names.size(), types.size());
  EXPECT_EQ(builtin_hook_names(), std::vector<std::string>(names.begin(), names.end()));
}

// The names are what pickles of smp._C.BuiltinHook store: they never change.
TEST(BuiltinCommHookType, NamesAreTheStableOnes) {
  EXPECT_EQ(builtin_hook_name(T::kAllreduce), "allreduce");
  EXPECT_EQ(builtin_hook_name(T::kFp16Compress), "fp16_compress");
  EXPECT_EQ(builtin_hook_name(T::kBf16Compress), "bf16_compress");
  EXPECT_EQ(builtin_hook_name(T::kNoop), "noop");
  EXPECT_EQ(builtin_hook_name(T::kFp16CompressWrapper), "fp16_compress_wrapper");
  EXPECT_EQ(builtin_hook_name(T::kBf16CompressWrapper), "bf16_compress_wrapper");
  EXPECT_EQ(builtin_hook_name(T::kPowerSGD), "powerSGD");
  EXPECT_EQ(builtin_hook_name(T::kBatchedPowerSGD), "batched_powerSGD");
  EXPECT_EQ(builtin_hook_name(T::kQuantizePerTensor), "quantization_pertensor");
  EXPECT_EQ(builtin_hook_name(T::kQuantizePerChannel), "quantization_perchannel");
}

TEST(BuiltinCommHookType, Kinds) {
  for (T t : builtin_hook_types()) {
    const bool wrapper = t == T::kFp16CompressWrapper || t == T::kBf16CompressWrapper;
    const bool powersgd = t == T::kPowerSGD || t == T::kBatchedPowerSGD;
    EXPECT_EQ(is_wrapper(t), wrapper) << builtin_hook_name(t);
    EXPECT_EQ(is_wrapper(builtin_hook_name(t)), wrapper) << builtin_hook_name(t);
    EXPECT_EQ(is_powersgd(t), powersgd) << builtin_hook_name(t);
  }
  EXPECT_FALSE(is_wrapper("no_such_hook"));
}

// An unknown name: ConfigError naming the value and every allowed name. Case matters
// (the names are those of torch's hook functions).
TEST(BuiltinCommHookType, UnknownNameNamesTheValueAndTheAllowedOnes) {
  for (const std::string bad : {"powersgd", "", "ALLREDUCE", "allreduce_hook"}) {
    try {
      builtin_hook_type(bad);
      FAIL() << "accepted '" << bad << "'";
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()),
                "smp: built-in hook '" + bad + "' is not one of {allreduce, "
                "batched_powerSGD, bf16_compress, bf16_compress_wrapper, fp16_compress, "
                "fp16_compress_wrapper, noop, powerSGD, quantization_perchannel, "
                "quantization_pertensor}");
    }
  }
  // make_builtin_hook by name says the same.
  EXPECT_THROW(make_builtin_hook("powersgd"), ConfigError);
}

TEST(BuiltinCommHookType, AValueOutsideTheEnumIsRefusedByNumber) {
  try {
    builtin_hook_name(static_cast<T>(42));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "smp: BuiltinCommHookType 42 is not a built-in hook (0..9)");
  }
}

// make_builtin_hook by type and by name give the same hook; `inner` only for wrappers.
TEST(BuiltinCommHookType, MakeByTypeMatchesByName) {
  for (T t : builtin_hook_types()) {
    const std::string& name = builtin_hook_name(t);
    CommHookPtr inner = is_wrapper(t) ? allreduce_hook() : nullptr;
    auto by_type = make_builtin_hook(t, {}, inner);
    auto by_name = make_builtin_hook(name, {}, inner);
    EXPECT_EQ(by_type->name(), by_name->name()) << name;
    // Each hook goes by its table entry (a wrapper adds what it wraps).
    EXPECT_EQ(by_type->name(), is_wrapper(t) ? name + "(allreduce)" : name);
  }
  try {
    make_builtin_hook(T::kFp16CompressWrapper);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "smp: built-in hook 'fp16_compress_wrapper' wraps another hook: pass inner=");
  }
  try {
    make_builtin_hook(T::kNoop, {}, allreduce_hook());
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "smp: built-in hook 'noop' takes no inner hook (only "
                           "fp16_compress_wrapper and bf16_compress_wrapper do)");
  }
}

}  // namespace
}  // namespace smp::hooks
