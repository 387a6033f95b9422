// The fused optimizers' chunking and dtype conversions (Note [Fused optimizer kernels]
// in detail/multi_tensor.h).
#include "smp_core/optim/detail/multi_tensor.h"

#include <algorithm>
#include <cstring>
#include <string>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SMP_OPTIM_F16C 1
#endif

#include "smp_core/errors.h"

namespace smp::optim::detail {

std::vector<Chunk> make_chunks(const std::vector<int64_t>& numels, size_t first, size_t last) {
  std::vector<Chunk> chunks;
  for (size_t t = first; t < last; ++t) {
    for (int64_t b = 0; b < numels[t]; b += kChunk) {
      chunks.push_back({static_cast<int64_t>(t), b, std::min(numels[t], b + kChunk)});
    }
  }
  return chunks;
}

std::vector<std::pair<size_t, size_t>> make_blocks(const std::vector<int64_t>& numels,
                                                   int64_t block_elems) {
  std::vector<std::pair<size_t, size_t>> blocks;
  size_t first = 0;
  int64_t size = 0;
  for (size_t t = 0; t < numels.size(); ++t) {
    if (t > first && size + numels[t] > block_elems) {
      blocks.emplace_back(first, t);
      first = t;
      size = 0;
    }
    size += numels[t];
  }
  if (first < numels.size()) blocks.emplace_back(first, numels.size());
  return blocks;
}

namespace {

// bf16 -> fp32 is exact (the high half of the fp32 bits); fp32 -> bf16 rounds to
// nearest even, NaN to a quiet NaN, as c10::BFloat16 does.
SMP_OPTIM_CLONES void bf16_to_float(const uint16_t* __restrict src, float* __restrict dst,
                                    int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(&dst[i], &bits, sizeof(float));
  }
}

SMP_OPTIM_CLONES void float_to_bf16(const float* __restrict src, uint16_t* __restrict dst,
                                    int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &src[i], sizeof(float));
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    dst[i] = src[i] != src[i] ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  }
}

// fp16 through c10::Half's bit arithmetic (vectorized by the AVX-512 clone only).
SMP_OPTIM_CLONES void half_to_float_c10(const c10::Half* __restrict src,
                                        float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

SMP_OPTIM_CLONES void float_to_half_c10(const float* __restrict src,
                                        c10::Half* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(src[i]);
}

#ifdef SMP_OPTIM_F16C
// fp16 through the F16C instructions, 8 at a time: the same IEEE conversions (round to
// nearest even) as c10::Half.
__attribute__((target("avx,f16c"))) void half_to_float_f16c(const c10::Half* src,
                                                              float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

__attribute__((target("avx,f16c"))) void float_to_half_f16c(const float* src,
                                                              c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);
}

bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return yes;
}
#endif

}  // namespace

void to_float(at::ScalarType dtype, const void* src, float* dst, int64_t n) {
  switch (dtype) {
    case at::kFloat:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case at::kBFloat16:
      bf16_to_float(static_cast<const uint16_t*>(src), dst, n);
      return;
    case at::kHalf:
#ifdef SMP_OPTIM_F16C
      if (has_f16c()) return half_to_float_f16c(static_cast<const c10::Half*>(src), dst, n);
#endif
      half_to_float_c10(static_cast<const c10::Half*>(src), dst, n);
      return;
    default:
      SMP_CHECK(false, "optim: dtype ", dtype, " is not one of {float32, float16, bfloat16}");
  }
}

void from_float(at::ScalarType dtype, const float* src, void* dst, int64_t n) {
  switch (dtype) {
    case at::kFloat:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case at::kBFloat16:
      float_to_bf16(src, static_cast<uint16_t*>(dst), n);
      return;
    case at::kHalf:
#ifdef SMP_OPTIM_F16C
      if (has_f16c()) return float_to_half_f16c(src, static_cast<c10::Half*>(dst), n);
#endif
      float_to_half_c10(src, static_cast<c10::Half*>(dst), n);
      return;
    default:
      SMP_CHECK(false, "optim: dtype ", dtype, " is not one of {float32, float16, bfloat16}");
  }
}

Writable::Writable(const at::Tensor& t)
    : original(t), data(t.is_contiguous() ? t : t.contiguous()) {}

void Writable::write_back() {
  if (!data.is_same(original)) original.copy_(data);
}

void check_group(const char* op, const std::vector<at::Tensor>& params,
                 const std::vector<at::Tensor>& grads, const std::vector<StateList>& states,
                 const std::vector<int64_t>& steps) {
  size_t n = params.size();
  bool sizes_match = grads.size() == n && steps.size() == n;
  std::string counts = str_cat(grads.size(), " grads, ");
  for (const auto& s : states) {
    sizes_match = sizes_match && s.tensors.size() == n;
    counts += str_cat(s.tensors.size(), " ", s.name, ", ");
  }
  SMP_CHECK(sizes_match, "optim: ", op, ": ", n, " params but ", counts, "and ", steps.size(),
            " steps");
  for (size_t i = 0; i < n; ++i) {
    const auto& p = params[i];
    const auto& g = grads[i];
    auto dt = p.scalar_type();
    SMP_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "optim: ", op,
              ": param ", i, " has dtype ", dt, ", not one of {float32, float16, bfloat16}");
    SMP_CHECK(g.scalar_type() == dt && g.sizes() == p.sizes(), "optim: ", op, ": param ", i,
              " is ", dt, p.sizes(), " but its grad ", g.scalar_type(), g.sizes());
    SMP_CHECK(g.device() == p.device(), "optim: ", op, ": param ", i, " is on ", p.device(),
              " but its grad on ", g.device());
    for (const auto& s : states) {
      const auto& t = s.tensors[i];
      bool ok = t.scalar_type() == at::kFloat && t.device() == p.device() &&
                (s.per_element ? t.is_contiguous() && t.numel() == p.numel() : t.numel() == 1);
      SMP_CHECK(ok, "optim: ", op, ": ", s.name, "[", i, "] is not a ",
                s.per_element ? "contiguous " : "one-element ", "float32 tensor",
                s.per_element ? str_cat(" of ", p.numel(), " elements") : std::string(),
                " on ", p.device(), ": ", t.scalar_type(), t.sizes(), " on ", t.device());
    }
    SMP_CHECK(steps[i] >= 1, "optim: ", op, ": steps[", i, "]=", steps[i], " is not >= 1");
  }
}

CpuGroup::CpuGroup(const std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& gs) {
  params.reserve(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    params.emplace_back(ps[i]);
    grads.push_back(gs[i].contiguous());
    numels.push_back(ps[i].numel());
  }
}

void CpuGroup::write_back() {
  for (auto& p : params) p.write_back();
}

}  // namespace smp::optim::detail
