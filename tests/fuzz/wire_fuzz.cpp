// libFuzzer target: the pipeline transport's decoder (smp_core/detail/wire.h), which
// reads the words a peer sends over the TCP mesh: a header, then per tensor a
// descriptor, read as the receiver reads them. Anything must end in a described
// message whose parts add up to the byte count it claims, or a WireError; never a
// crash, an overflow, or a layout whose bytes differ from the count. Run by `make fuzz`;
// tests/cpp's corpus test replays the corpus.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "smp_core/detail/wire.h"

namespace w = smp::detail::wire;

namespace {

// The dtypes of torch's first ScalarType values (uint8 .. complex128, bool, bfloat16).
int element_size(int dtype) {
  static const int kSizes[] = {1, 1, 2, 4, 8, 2, 4, 8, 4, 8, 16, 1, 2};
  return dtype >= 0 && dtype < 13 ? kSizes[dtype] : 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int64_t head[w::kFixedWords] = {w::kMagic};
  // The first word is kept smp's magic 7 times in 8, so that the fuzzer explores past it.
  const size_t skip = size && data[0] % 8 ? 8 : 0;
  if (size < 1 + sizeof head - skip) return 0;
  std::memcpy(reinterpret_cast<char*>(head) + skip, data + 1, sizeof head - skip);
  size_t at = 1 + sizeof head - skip;
  try {
    const w::Header h = w::decode_header(head);
    if (h.closing) return 0;
    if (h.n_tensors < 0 || h.n_tensors > w::kMaxTensors) std::abort();
    if (h.meta_len < 0 || h.rng_len < 0 || h.meta_len > h.total || h.rng_len > h.total) std::abort();
    std::vector<w::TensorSpec> specs;
    for (int64_t i = 0; i < h.n_tensors; ++i) {
      int64_t desc[w::kWordsPerTensor] = {};
      const size_t n = std::min(sizeof desc, size - at);
      std::memcpy(desc, data + at, n);
      at += n;
      w::TensorSpec s = w::decode_tensor(desc, element_size);
      // What the receiver then allocates: the storage of these strides, which a dense
      // layout makes exactly the element count.
      int64_t numel = 1, storage = 1;
      for (int64_t n : s.sizes) numel *= n;
      if (numel == 0) {
        storage = 0;  // torch allocates nothing, whatever the strides
      } else {
        for (size_t k = 0; k < s.sizes.size(); ++k) storage += (s.sizes[k] - 1) * s.strides[k];
      }
      if (storage != numel || s.nbytes != numel * element_size(s.dtype)) std::abort();
      specs.push_back(std::move(s));
    }
    w::check_total(h, specs);
    if (w::message_bytes(h, specs) != h.total) std::abort();
  } catch (const w::WireError&) {
  }
  return 0;
}
