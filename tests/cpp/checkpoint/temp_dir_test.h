// The checkpoint tests' fixture: a fresh directory per test (removed after it), and
// the text of the CheckpointError a call throws.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

#include "checkpoint/checkpoint_error.h"

namespace smp::checkpoint::test {

class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           (std::string("smp_") + info->test_suite_name() + "_" + std::to_string(::getpid()) +
            "_" + info->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // "" when `fn` returns, else what its CheckpointError says.
  static std::string error_of(const std::function<void()>& fn) {
    try {
      fn();
    } catch (const CheckpointError& e) {
      return e.what();
    }
    return "";
  }

  std::filesystem::path dir_;
};

}  // namespace smp::checkpoint::test
