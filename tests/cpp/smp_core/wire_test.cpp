// The pipeline wire decoder against what a hostile or broken peer sends
// (smp_core/detail/wire.h); tests/cpp/fuzz replays the fuzzer's corpus besides.
#include <gtest/gtest.h>

#include "smp_core/detail/wire.h"

namespace w = smp::detail::wire;

namespace {

int element_size(int dtype) { return dtype == 6 ? 4 : dtype == 7 ? 8 : 0; }  // float, double

std::vector<int64_t> desc(int64_t dtype, std::vector<int64_t> sizes, std::vector<int64_t> strides) {
  std::vector<int64_t> d(w::kWordsPerTensor, 0);
  d[0] = dtype;
  d[1] = static_cast<int64_t>(sizes.size());
  for (size_t k = 0; k < sizes.size(); ++k) d[2 + k] = sizes[k];
  for (size_t k = 0; k < strides.size(); ++k) d[2 + w::kMaxDims + k] = strides[k];
  return d;
}

w::Header header(int64_t total, int64_t n_tensors, int64_t meta = 0) {
  const int64_t words[w::kFixedWords] = {w::kMagic, total, 0, 0, 1, meta, n_tensors, 0, 0};
  return w::decode_header(words);
}

TEST(Wire, DenseLayoutsDecodeWithTheirByteCount) {
  auto t = w::decode_tensor(desc(6, {4, 3}, {3, 1}).data(), element_size);
  EXPECT_EQ(t.nbytes, 48);
  auto transposed = w::decode_tensor(desc(7, {3, 4}, {1, 3}).data(), element_size);
  EXPECT_EQ(transposed.nbytes, 96);
  // Size-1 dims and empty tensors carry any stride (torch gives them such).
  EXPECT_EQ(w::decode_tensor(desc(6, {1, 5}, {999, 1}).data(), element_size).nbytes, 20);
  EXPECT_EQ(w::decode_tensor(desc(6, {0, 5}, {int64_t{1} << 60, 1}).data(), element_size).nbytes, 0);
  const int64_t bytes = 8 * (w::kFixedWords + w::kWordsPerTensor) + 48;
  EXPECT_NO_THROW(w::check_total(header(bytes, 1), {t}));
}

TEST(Wire, LayoutsThatWouldAllocateBeyondTheBytesAreRejected) {
  // A huge stride: empty_strided would allocate 2^40 elements for 2.
  EXPECT_THROW(w::decode_tensor(desc(6, {2}, {int64_t{1} << 40}).data(), element_size), w::WireError);
  // Overlapping elements, and a gap.
  EXPECT_THROW(w::decode_tensor(desc(6, {2, 2}, {1, 1}).data(), element_size), w::WireError);
  EXPECT_THROW(w::decode_tensor(desc(6, {2, 2}, {3, 1}).data(), element_size), w::WireError);
  // Sizes whose product overflows, negative ones, unknown dtypes, too many dims.
  EXPECT_THROW(w::decode_tensor(desc(7, {int64_t{1} << 40, int64_t{1} << 40}, {int64_t{1} << 40, 1}).data(),
                                element_size),
               w::WireError);
  EXPECT_THROW(w::decode_tensor(desc(6, {-2}, {1}).data(), element_size), w::WireError);
  EXPECT_THROW(w::decode_tensor(desc(99, {2}, {1}).data(), element_size), w::WireError);
  auto many = desc(6, {2}, {1});
  many[1] = w::kMaxDims + 1;
  EXPECT_THROW(w::decode_tensor(many.data(), element_size), w::WireError);
}

TEST(Wire, HeadersThatMisstateTheirBytesAreRejected) {
  const int64_t bad_magic[w::kFixedWords] = {42, 100, 0, 0, 1, 0, 0, 0, 0};
  EXPECT_THROW(w::decode_header(bad_magic), w::WireError);
  EXPECT_TRUE(header(0, 0).closing);
  EXPECT_THROW(header(8 * w::kFixedWords, 0, -1), w::WireError);           // negative meta
  EXPECT_THROW(header(8 * w::kFixedWords, w::kMaxTensors + 1), w::WireError);
  EXPECT_THROW(header(8 * w::kFixedWords + 10, 0, 11), w::WireError);     // meta beyond total
  EXPECT_THROW(header(100, 0, INT64_MAX), w::WireError);                  // sum overflows
  // A total that disagrees with the tensors it describes, either way.
  auto t = w::decode_tensor(desc(6, {4}, {1}).data(), element_size);
  const int64_t exact = 8 * (w::kFixedWords + w::kWordsPerTensor) + 16;
  EXPECT_THROW(w::check_total(header(exact + 1, 1), {t}), w::WireError);
  EXPECT_THROW(w::check_total(header(exact - 1, 1), {t}), w::WireError);
  EXPECT_NO_THROW(w::check_total(header(exact, 1), {t}));
}

}  // namespace
