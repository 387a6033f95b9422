// Norms over many tensors (Note [Fused optimizer kernels] in detail/multi_tensor.h).
#include "smp_core/optim/norms.h"

#include <algorithm>

#include "smp_core/errors.h"
#include "smp_core/optim/detail/generic.h"
#include "smp_core/optim/detail/multi_tensor.h"

namespace smp::optim {
namespace detail {
namespace {

SMP_OPTIM_CLONES void chunk_squares(const float* __restrict x, int64_t n, float* lanes) {
  add_squares(x, n, lanes);
}

SMP_OPTIM_CLONES void chunk_max_abs(const float* __restrict x, int64_t n, float* lanes) {
  max_abs(x, n, lanes);
}

}  // namespace

std::vector<double> reduce_tensors(const std::vector<at::Tensor>& tensors, size_t first,
                                   size_t last, bool max_abs) {
  std::vector<int64_t> numels;
  numels.reserve(tensors.size());
  for (const auto& t : tensors) numels.push_back(t.numel());
  auto chunks = make_chunks(numels, first, last);
  std::vector<double> partial(chunks.size());
  for_each_chunk(chunks, [&](int64_t c) {
    const Chunk& ch = chunks[c];
    const at::Tensor& t = tensors[ch.tensor];
    const auto* base = static_cast<const char*>(t.data_ptr()) + ch.begin * t.element_size();
    // fp32 lanes per tile (64 terms each), tiles added in double: the sum keeps ~1e-7.
    float buf[kTile];
    double sum = 0;
    float max_lanes[kLanes] = {};
    for (int64_t b = 0; b < ch.end - ch.begin; b += kTile) {
      int64_t n = std::min(kTile, ch.end - ch.begin - b);
      const float* x = reinterpret_cast<const float*>(base) + b;
      if (t.scalar_type() != at::kFloat) {
        to_float(t.scalar_type(), base + b * t.element_size(), buf, n);
        x = buf;
      }
      if (max_abs) {
        chunk_max_abs(x, n, max_lanes);
      } else {
        float lanes[kLanes] = {};
        chunk_squares(x, n, lanes);
        sum += sum_lanes(lanes);
      }
    }
    if (max_abs) {
      double m = 0;
      for (float l : max_lanes) m = (l > m || l != l) ? l : m;
      partial[c] = m;
    } else {
      partial[c] = sum;
    }
  });
  std::vector<double> out(last - first, 0.0);
  for (size_t c = 0; c < chunks.size(); ++c) {
    double& o = out[chunks[c].tensor - first];
    if (max_abs) {
      o = (partial[c] > o || partial[c] != partial[c]) ? partial[c] : o;
    } else {
      o += partial[c];
    }
  }
  return out;
}

}  // namespace detail

double sum_of_squares(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    SMP_CHECK(t.device().is_cpu(), "optim: sum_of_squares: tensor ", i, " is on ", t.device(),
              ", not the CPU");
    auto dt = t.scalar_type();
    SMP_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "optim: sum_of_squares: tensor ", i, " has dtype ", dt,
              ", not one of {float32, float16, bfloat16}");
    flat.push_back(t.contiguous());
  }
  double total = 0;
  for (double s : detail::reduce_tensors(flat, 0, flat.size(), false)) total += s;
  return total;
}

at::Tensor sum_of_squares_tensor(const std::vector<at::Tensor>& tensors) {
  if (detail::use_generic(tensors)) return detail::sum_of_squares_generic(tensors);
  return detail::host_scalar(sum_of_squares(tensors));
}

}  // namespace smp::optim
