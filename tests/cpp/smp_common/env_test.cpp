// Reading the environment (smp_common/env.h), as smprun and each rank do.
#include "smp_common/env.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace smp::common {
namespace {

TEST(ParseInt, StrictDecimal) {
  EXPECT_EQ(parse_int("42"), 42);
  EXPECT_EQ(parse_int("-3"), -3);
  EXPECT_EQ(parse_int("+7"), 7);
  EXPECT_EQ(parse_int("2147483647"), 2147483647);
  for (const char* bad : {"", "-", "4x", " 4", "\t4", "4 ", "4 2", "99999999999", "0x10", "1e3"})
    EXPECT_FALSE(parse_int(bad)) << "'" << bad << "'";
}

TEST(Trim, DropsSurroundingWhitespaceOnly) {
  EXPECT_EQ(trim(" \t4 2\r\n"), "4 2");
  EXPECT_EQ(trim("  "), "");
  EXPECT_EQ(trim(""), "");
  EXPECT_EQ(parse_int(trim(" 12\n")), 12);
}

TEST(CurrentEnv, SnapshotOfEnviron) {
  setenv("SMP_COMMON_TEST_VAR", "a=b", 1);  // the first '=' splits name from value
  EnvMap env = current_env();
  EXPECT_EQ(env.at("SMP_COMMON_TEST_VAR"), "a=b");
  unsetenv("SMP_COMMON_TEST_VAR");
  EXPECT_EQ(current_env().count("SMP_COMMON_TEST_VAR"), 0u);
}

TEST(DefaultMasterPort, IsTorchrunsDefault) { EXPECT_EQ(kDefaultMasterPort, 29500); }

}  // namespace
}  // namespace smp::common
