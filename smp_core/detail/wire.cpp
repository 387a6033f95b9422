#include "smp_core/detail/wire.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace smp::detail::wire {
namespace {

[[noreturn]] void bad(const std::string& what) { throw WireError("bad message: " + what); }

int64_t add(int64_t a, int64_t b, const char* what) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) bad(std::string(what) + " overflows");
  return out;
}

int64_t mul(int64_t a, int64_t b, const char* what) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) bad(std::string(what) + " overflows");
  return out;
}

int64_t fixed_bytes(int64_t n_tensors) {
  return mul(add(static_cast<int64_t>(kFixedWords), mul(n_tensors, kWordsPerTensor, "descriptors"),
                 "header"),
             8, "header");
}

}  // namespace

Header decode_header(const int64_t (&w)[kFixedWords]) {
  if (w[0] != kMagic) bad("magic word is not smp's");
  Header h;
  h.total = w[1];
  if (h.total == 0) {
    h.closing = true;
    return h;
  }
  h.mb = w[2];
  h.call_id = w[3];
  if (w[4] < 0 || w[4] > INT32_MAX) bad("kind " + std::to_string(w[4]));
  h.kind = static_cast<int32_t>(w[4]);
  h.meta_len = w[5];
  h.n_tensors = w[6];
  h.epoch = w[7];
  h.rng_len = w[8];
  h.autocast = w[9];
  if (h.meta_len < 0 || h.rng_len < 0 || h.n_tensors < 0 || h.n_tensors > kMaxTensors)
    bad("negative length or " + std::to_string(h.n_tensors) + " tensors");
  // Bounds what the receiver allocates before it reads the tensors' descriptors.
  const int64_t before_tensors = add(add(fixed_bytes(h.n_tensors), h.meta_len, "meta"), h.rng_len,
                                     "rng");
  if (h.total < before_tensors)
    bad("byte count " + std::to_string(h.total) + " below its header's " +
        std::to_string(before_tensors));
  return h;
}

TensorSpec decode_tensor(const int64_t* t, ElementSize element_size) {
  TensorSpec s;
  const int64_t flags = t[0] & ~kDtypeMask;
  if (t[0] < 0 || (flags & ~(kByC10d | kOnCuda)) != 0) bad("tensor flags");
  s.dtype = static_cast<int>(t[0] & kDtypeMask);
  s.by_c10d = t[0] & kByC10d;
  s.on_cuda = t[0] & kOnCuda;
  const int esize = element_size(s.dtype);
  if (esize <= 0) bad("dtype " + std::to_string(s.dtype));
  const int64_t ndim = t[1];
  if (ndim < 0 || ndim > kMaxDims) bad(std::to_string(ndim) + " dims");
  s.sizes.assign(t + 2, t + 2 + ndim);
  s.strides.assign(t + 2 + kMaxDims, t + 2 + kMaxDims + ndim);
  int64_t numel = 1;
  for (int64_t k = 0; k < ndim; ++k) {
    if (s.sizes[k] < 0 || s.strides[k] < 0) bad("negative size or stride");
    numel = mul(numel, s.sizes[k], "element count");
  }
  s.nbytes = mul(numel, esize, "byte count");
  // Note [Layout travels]: dense and non-overlapping, so the storage is exactly numel
  // elements (what torch's is_non_overlapping_and_dense asks of the sender): dims of
  // more than one element, in stride order, each stride the product of the sizes below.
  // An empty tensor has no storage whatever its strides.
  if (numel > 1) {
    std::vector<int64_t> order(static_cast<size_t>(ndim));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return s.strides[a] < s.strides[b]; });
    int64_t expected = 1;
    for (int64_t d : order) {
      if (s.sizes[d] == 1) continue;
      if (s.strides[d] != expected) bad("layout is not dense");
      expected *= s.sizes[d];  // <= numel: no overflow
    }
  }
  return s;
}

int64_t message_bytes(const Header& h, const std::vector<TensorSpec>& tensors) {
  int64_t n = add(add(fixed_bytes(static_cast<int64_t>(tensors.size())), h.meta_len, "meta"),
                  h.rng_len, "rng");
  for (const auto& s : tensors) n = add(n, s.nbytes, "byte count");
  return n;
}

void check_total(const Header& h, const std::vector<TensorSpec>& tensors) {
  const int64_t n = message_bytes(h, tensors);
  if (n != h.total)
    bad("byte count " + std::to_string(h.total) + " is not its parts' " + std::to_string(n));
}

}  // namespace smp::detail::wire
