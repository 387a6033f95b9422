#include "smp_core/task_rng.h"

#include <cstring>
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/empty.h>

#include "smp_core/compat/cuda_generator.h"
#include "smp_core/errors.h"

namespace smp::task_rng {
namespace {

// Layout: per part, int64 kind (0 CPU, 1 CUDA), int64 device index, int64 length, bytes.
void put_part(std::string& out, int64_t kind, int64_t device, const at::Tensor& state) {
  const int64_t len = state.numel();
  const int64_t words[3] = {kind, device, len};
  out.append(reinterpret_cast<const char*>(words), sizeof words);
  out.append(reinterpret_cast<const char*>(state.data_ptr()), static_cast<size_t>(len));
}

at::Tensor get_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_state(at::Generator gen, const char* bytes, int64_t len) {
  at::Tensor t = at::empty({len}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(t.data_ptr(), bytes, static_cast<size_t>(len));
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(t);
}

bool cuda_usable() { return at::globalContext().hasCUDA(); }

at::Generator cuda_generator(int64_t device) { return compat::default_cuda_generator(device); }

int64_t current_cuda_device() { return at::detail::getCUDAHooks().current_device(); }

// splitmix64's finalizer: distinct, well-spread seeds for neighbouring microbatches.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

std::string capture(bool cuda) {
  std::string out;
  put_part(out, 0, -1, get_state(at::detail::getDefaultCPUGenerator()));
  if (cuda && cuda_usable()) {
    const int64_t dev = current_cuda_device();
    put_part(out, 1, dev, get_state(cuda_generator(dev)));
  }
  return out;
}

std::string capture_like(const std::string& like) {
  // A CUDA part follows the CPU one (capture, derive): its kind word sits after the CPU
  // part's header and bytes.
  bool cuda = false;
  if (like.size() >= 3 * sizeof(int64_t)) {
    int64_t words[3];
    std::memcpy(words, like.data(), sizeof words);
    const size_t next = sizeof words + static_cast<size_t>(words[2]);
    int64_t kind = 0;
    if (like.size() >= next + sizeof kind) std::memcpy(&kind, like.data() + next, sizeof kind);
    cuda = kind == 1;
  }
  return capture(cuda);
}

void install(const std::string& state) {
  size_t at = 0;
  while (at < state.size()) {
    int64_t words[3];
    SMP_CHECK(state.size() - at >= sizeof words, "task_rng: truncated generator state");
    std::memcpy(words, state.data() + at, sizeof words);
    at += sizeof words;
    SMP_CHECK(words[2] >= 0 && static_cast<size_t>(words[2]) <= state.size() - at,
              "task_rng: truncated generator state");
    const char* bytes = state.data() + at;
    at += static_cast<size_t>(words[2]);
    if (words[0] == 0) {
      set_state(at::detail::getDefaultCPUGenerator(), bytes, words[2]);
    } else if (words[0] == 1 && cuda_usable()) {
      set_state(cuda_generator(words[1]), bytes, words[2]);
    }
  }
}

std::string derive(uint64_t step_seed, int64_t mb, bool cuda) {
  const uint64_t seed = mix(step_seed ^ mix(static_cast<uint64_t>(mb)));
  std::string out;
  put_part(out, 0, -1, get_state(at::make_generator<at::CPUGeneratorImpl>(seed)));
  if (cuda && cuda_usable()) {
    // A CUDA generator's state for `seed`: the default one's, reseeded, then put back.
    const int64_t dev = current_cuda_device();
    at::Generator gen = cuda_generator(dev);
    std::lock_guard<std::mutex> lock(gen.mutex());
    at::Tensor saved = gen.get_state();
    gen.set_current_seed(seed);
    put_part(out, 1, dev, gen.get_state());
    gen.set_state(saved);
  }
  return out;
}

uint64_t draw_step_seed() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get<at::CPUGeneratorImpl>()->random64();
}

}  // namespace smp::task_rng
