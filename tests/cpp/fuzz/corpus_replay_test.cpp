// Replays a libFuzzer target's corpus and every crash it found (tests/fuzz/corpus/<t>,
// tests/fuzz/crashes/<t>) through the target's own harness, in the normal build: a
// decoder that regresses on an input the fuzzer once saw crashes or aborts this test.
// Linked once per target (the harness defines LLVMFuzzerTestOneInput);
// SMP_FUZZ_CORPUS and SMP_FUZZ_CRASHES name its folders. `make fuzz` explores further (docs/fuzzing.md).
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

std::vector<std::filesystem::path> inputs() {
  std::vector<std::filesystem::path> out;
  for (const std::string dir : {SMP_FUZZ_CORPUS, SMP_FUZZ_CRASHES}) {
    if (!std::filesystem::is_directory(dir)) continue;
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (e.is_regular_file()) out.push_back(e.path());
  }
  return out;
}

TEST(FuzzCorpus, EveryInputDecodesOrIsRejected) {
  const auto files = inputs();
  ASSERT_FALSE(files.empty()) << "no corpus in " << SMP_FUZZ_CORPUS;
  for (const auto& f : files) {
    SCOPED_TRACE(f.string());
    std::ifstream in(f, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 0);
  }
}

// Every prefix of every input too: what a peer cut off mid-message, or a truncated
// file, sends.
TEST(FuzzCorpus, EveryPrefixDecodesOrIsRejected) {
  for (const auto& f : inputs()) {
    SCOPED_TRACE(f.string());
    std::ifstream in(f, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (size_t n = 0; n < bytes.size(); n += 1 + bytes.size() / 64)
      EXPECT_EQ(LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), n), 0);
  }
}

}  // namespace
