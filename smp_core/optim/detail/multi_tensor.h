// The multi-tensor machinery of the fused optimizers (internal; included only from
// smp_core/optim/*.cpp and their tests): a parameter group cut into fixed chunks that
// at::parallel_for shares between threads, tiles converted to fp32 and back, and sums
// over 16 lanes that the compiler vectorizes.
//
// Note [Fused optimizer kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A step is one pass (or two, LAMB's trust ratio needs each tensor's norms first) over
// every tensor of a parameter group, not one torch op per tensor per term:
// - Work is cut into chunks of kChunk elements of one tensor each, numbered in the
//   group's order; at::parallel_for gives each thread a contiguous run of chunks. A
//   chunk's sums go to its own slot and the slots add up in chunk order, so a norm does
//   not depend on the number of threads.
// - Tensors are taken in blocks of up to kBlockElems elements (a tensor larger than
//   that is a block alone): a block's second pass runs right after its first, and the
//   same thread takes the same chunks in both (parallel_for splits the same range the
//   same way), so what the first pass wrote may still be in that core's caches.
// - at::parallel_for is header code: these files build with OpenMP, on torch's threads
//   (smp_core/CMakeLists.txt says why that is one runtime).
// - Inside a chunk, tiles of kTile elements: an fp16/bf16 tile is converted to fp32 in
//   a buffer on the stack, the fp32 loop runs, and the parameter goes back in its
//   dtype (round to nearest even, as torch's .to()). Math is fp32; state is fp32.
// - Elementwise loops are plain loops the compiler vectorizes. Sums run over kLanes
//   independent lanes held as one GCC vector (Lanes; lane j adds the elements i with
//   i % kLanes == j, add_squares keeps four such vectors in turn and adds them in a
//   fixed order), which the compiler maps on vectors of any width without reordering
//   a sum: the AVX-512, AVX2 and baseline clones (SMP_OPTIM_CLONES) give the same
//   bits. A tile's lanes add up in double, then the tiles, then the chunks: a norm
//   keeps ~1e-7 of relative precision. The files build with -ffp-contract=off (no
//   fused multiply-adds that one clone would have and another not) and
//   -fno-math-errno (sqrt vectorizes).
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

// The function is compiled for AVX-512 (x86-64-v4), AVX2+FMA+F16C (x86-64-v3) and the
// baseline, and the loader picks one for the CPU it runs on (GCC's target_clones).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SMP_OPTIM_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SMP_OPTIM_CLONES
#endif
#if defined(__GNUC__)
#define SMP_OPTIM_INLINE inline __attribute__((always_inline))
#else
#define SMP_OPTIM_INLINE inline
#endif

namespace smp::optim::detail {

// Independent accumulators of a sum (a 512-bit vector of floats).
constexpr int kLanes = 16;
// Elements converted to fp32 at a time (three fp32 buffers of it on the stack).
constexpr int64_t kTile = 1024;
// Elements of one unit of parallel work (256 KiB of fp32).
constexpr int64_t kChunk = int64_t{1} << 16;
// Elements of one block of tensors whose two passes run back to back (Note [Fused
// optimizer kernels]): 4M, 16 MiB per fp32 array. LAMB keeps a block's updates between
// its passes in a buffer of this size per calling thread (Note [LAMB step]).
constexpr int64_t kBlockElems = int64_t{1} << 22;

// A run of elements [begin, end) of tensor `tensor` of a group.
struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// The chunks of tensors [first, last) of sizes `numels`, in order.
std::vector<Chunk> make_chunks(const std::vector<int64_t>& numels, size_t first, size_t last);

// Consecutive ranges [first, last) of tensors of at most `block_elems` elements each (a
// larger tensor alone), covering every tensor.
std::vector<std::pair<size_t, size_t>> make_blocks(const std::vector<int64_t>& numels,
                                                   int64_t block_elems);

// Runs fn(chunk_index) for every chunk, in parallel over torch's intra-op threads.
template <class Fn>
void for_each_chunk(const std::vector<Chunk>& chunks, const Fn& fn) {
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) fn(c);
  });
}

// n elements of `src` (dtype fp32, fp16 or bf16) as fp32, and back (round to nearest
// even). `src`/`dst` point at the first element.
void to_float(at::ScalarType dtype, const void* src, float* dst, int64_t n);
void from_float(at::ScalarType dtype, const float* src, void* dst, int64_t n);

// kLanes fp32 lanes as one value (a GCC vector: one AVX-512 register, two AVX2, four
// SSE): lane j of a sum adds the elements i with i % kLanes == j, whatever the width.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t LaneBits __attribute__((vector_size(kLanes * sizeof(float))));
// They cross no call (the helpers below are always inlined): GCC's note on how a 64-byte
// vector is passed without AVX-512 does not apply, to the end of the including file.
#pragma GCC diagnostic ignored "-Wpsabi"

SMP_OPTIM_INLINE Lanes load_lanes(const float* x) {
  Lanes v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

// The last n < kLanes elements, the other lanes zero.
SMP_OPTIM_INLINE Lanes load_tail(const float* x, int64_t n) {
  float tail[kLanes] = {};
  std::memcpy(tail, x, n * sizeof(float));
  return load_lanes(tail);
}

// The sum of the lanes, in lane order, in double.
SMP_OPTIM_INLINE double sum_lanes(const float* lanes) {
  double s = 0;
  for (int j = 0; j < kLanes; ++j) s += lanes[j];
  return s;
}

// lanes += x^2 over n fp32 elements. Four accumulators in turn (elements 16k..16k+15
// to accumulator k % 4, added together at the end in a fixed order), so that the adds
// do not wait on each other: the same sum on every instruction set.
SMP_OPTIM_INLINE void add_squares(const float* __restrict x, int64_t n,
                                  float* __restrict lanes) {
  Lanes acc[4] = {load_lanes(lanes), {}, {}, {}};
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    for (int k = 0; k < 4; ++k) {
      Lanes v = load_lanes(x + i + k * kLanes);
      acc[k] += v * v;
    }
  }
  for (int k = 0; i < n; i += kLanes, ++k) {
    Lanes v = i + kLanes <= n ? load_lanes(x + i) : load_tail(x + i, n - i);
    acc[k] += v * v;
  }
  Lanes total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  std::memcpy(lanes, &total, sizeof total);
}

// lanes = max(lanes, |x|) over n fp32 elements (a NaN stays).
SMP_OPTIM_INLINE void max_abs(const float* __restrict x, int64_t n, float* __restrict lanes) {
  Lanes acc = load_lanes(lanes);
  auto step = [&](Lanes v) {
    Lanes a = reinterpret_cast<Lanes>(reinterpret_cast<LaneBits>(v) & 0x7fffffff);
    acc = ((a > acc) | (a != a)) ? a : acc;
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) step(load_lanes(x + i));
  if (i < n) step(load_tail(x + i, n - i));
  std::memcpy(lanes, &acc, sizeof acc);
}

// A tile of a tensor as fp32: its own memory (fp32) or `buf` holding a converted copy.
struct Tile {
  const at::Tensor& tensor;
  int64_t offset;
  int64_t n;
  float* data;
  Tile(const at::Tensor& t, int64_t offset, int64_t n, float* buf)
      : tensor(t), offset(offset), n(n) {
    auto* base = static_cast<char*>(t.data_ptr()) + offset * t.element_size();
    if (t.scalar_type() == at::kFloat) {
      data = reinterpret_cast<float*>(base);
    } else {
      to_float(t.scalar_type(), base, buf, n);
      data = buf;
    }
  }
  // Writes a converted tile back in the tensor's dtype.
  void store() {
    if (tensor.scalar_type() != at::kFloat) {
      auto* base = static_cast<char*>(tensor.data_ptr()) + offset * tensor.element_size();
      from_float(tensor.scalar_type(), data, base, n);
    }
  }
};

// Element `offset` of an fp32 state tensor (contiguous).
inline float* state_at(const at::Tensor& t, int64_t offset) {
  return t.data_ptr<float>() + offset;
}

// Per tensor t in [first, last) of `tensors` (contiguous, CPU, fp32/fp16/bf16): the sum
// of x^2, or max |x| with `max_abs`, in chunk order (norms.cpp).
std::vector<double> reduce_tensors(const std::vector<at::Tensor>& tensors, size_t first,
                                   size_t last, bool max_abs);

// The contiguous tensor a kernel writes: `t` itself, or a contiguous copy that
// write_back() copies into `t`.
struct Writable {
  at::Tensor original;
  at::Tensor data;
  explicit Writable(const at::Tensor& t);
  void write_back();
};

// One list of a step's state, as check_group() sees it: its name in messages
// ("exp_avgs"), and whether each tensor holds one element per parameter element
// (contiguous) or one element for the whole parameter.
struct StateList {
  const char* name;
  const std::vector<at::Tensor>& tensors;
  bool per_element;
};

// Checks a parameter group's lists as lamb_step and novograd_step take them (either
// path): as many of each; each param fp32, fp16 or bf16 with a grad of its dtype and
// shape on its device; each state fp32 on the param's device; every step >= 1. Throws
// std::runtime_error "optim: <op>: ..." naming the first mismatch.
void check_group(const char* op, const std::vector<at::Tensor>& params,
                 const std::vector<at::Tensor>& grads, const std::vector<StateList>& states,
                 const std::vector<int64_t>& steps);

// A group as the CPU kernels read it: each parameter Writable, each gradient
// contiguous, and their sizes; write_back() copies into non-contiguous parameters.
struct CpuGroup {
  std::vector<Writable> params;
  std::vector<at::Tensor> grads;
  std::vector<int64_t> numels;
  CpuGroup(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads);
  void write_back();
};

}  // namespace smp::optim::detail
