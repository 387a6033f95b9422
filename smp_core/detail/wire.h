// The pipeline transport's wire format (Note [Wire format] in p2p.cpp) and its decoder:
// every word a peer sent is checked here before anything is allocated or read from it.
// No torch, so that tests/fuzz/wire_fuzz.cpp can fuzz it in a build of its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace smp::detail::wire {

constexpr int64_t kMagic = 0x736d7034;  // "smp4" (9 header words were "smp3")
constexpr int kMaxDims = 8;
constexpr size_t kFixedWords = 10;
constexpr size_t kWordsPerTensor = 2 + 2 * kMaxDims;
constexpr int64_t kByC10d = int64_t{1} << 16;
constexpr int64_t kOnCuda = int64_t{1} << 17;
constexpr int64_t kDtypeMask = 0xffff;
// More tensors than one message of any module call has (a guard on the descriptors'
// allocation, which the header's byte count bounds too).
constexpr int64_t kMaxTensors = int64_t{1} << 16;

// A message that does not follow the format; what() says which word is wrong.
class WireError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The fixed words of a message.
struct Header {
  bool closing = false;  // total_bytes 0: the sender's engine is shutting down
  int64_t total = 0, mb = 0, call_id = 0;
  int32_t kind = 0;
  int64_t meta_len = 0, n_tensors = 0, epoch = 0, rng_len = 0;
  int64_t autocast = 0;  // Message::autocast, opaque here (autocast_state.cpp checks it)
};

// One tensor's descriptor, checked: a layout whose elements are dense and do not
// overlap (Note [Layout travels]), so its bytes are exactly `nbytes`.
struct TensorSpec {
  int dtype = 0;
  bool by_c10d = false, on_cuda = false;
  std::vector<int64_t> sizes, strides;
  int64_t nbytes = 0;
};

// Bytes per element of a dtype (a c10::ScalarType's value), 0 when it is not one the
// receiver can allocate.
using ElementSize = int (*)(int dtype);

// Throws WireError unless `w` is a well-formed header: magic, non-negative lengths,
// and a byte count that holds the header, descriptors, meta and rng bytes.
Header decode_header(const int64_t (&w)[kFixedWords]);

// Throws WireError unless `words` (kWordsPerTensor of them) describe a dense tensor of
// a known dtype whose byte count fits in int64.
TensorSpec decode_tensor(const int64_t* words, ElementSize element_size);

// The bytes a message of this header and these tensors has (what `total` must say).
int64_t message_bytes(const Header& h, const std::vector<TensorSpec>& tensors);

// Throws WireError unless the header's total is exactly message_bytes: a peer cannot
// make this rank read more (or fewer) bytes than the message it described.
void check_total(const Header& h, const std::vector<TensorSpec>& tensors);

}  // namespace smp::detail::wire
