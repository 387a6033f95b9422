#include "hooks/detail/powersgd_math.h"

#include <ATen/ATen.h>

namespace smp::hooks::detail {
namespace {

bool cpu_half(const at::Tensor& t) { return t.scalar_type() == at::kHalf && !t.is_cuda(); }

void gram_schmidt(const at::Tensor& m, double epsilon) {
  const int64_t cols = m.size(2);
  for (int64_t i = 0; i < cols; ++i) {
    at::Tensor col = m.narrow(2, i, 1);
    // torch's hook: torch.linalg.vector_norm(col, dim=1, keepdim=True) (at::frobenius_norm
    // is deprecated in torch 2.x and warns on every call).
    const int64_t dim = 1;
    at::Tensor norm = at::linalg_vector_norm(col, 2, at::IntArrayRef(dim), /*keepdim=*/true);
    if (epsilon == 0)
      col.div_(norm);
    else
      col.div_(norm + epsilon);
    if (i + 1 < cols) {
      at::Tensor rest = m.narrow(2, i + 1, cols - i - 1);
      rest.sub_(at::sum(col * rest, {1}, /*keepdim=*/true) * col);
    }
  }
}

}  // namespace

bool should_compress(int64_t n, int64_t m, int64_t rank, double min_compression_rate) {
  const double compressed = static_cast<double>((n + m) * rank);
  return compressed * min_compression_rate < static_cast<double>(n * m);
}

void orthogonalize(const at::Tensor& m, double epsilon) {
  if (m.numel() == 0) return;
  if (cpu_half(m)) {  // CPU has no float16 norm/matmul kernels in torch 1.13
    at::Tensor f = m.to(at::kFloat);
    gram_schmidt(f, epsilon);  // torch: 16-bit dtypes always take Gram-Schmidt
    m.copy_(f);
    return;
  }
  const auto dtype = m.scalar_type();
  if (m.size(2) <= 2 || dtype == at::kHalf || dtype == at::kBFloat16) {
    gram_schmidt(m, epsilon);
  } else {
    m.copy_(std::get<0>(at::linalg_qr(m)));
  }
}

void bmm_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (out.numel() == 0) return;
  if (cpu_half(out)) {
    out.copy_(at::bmm(a.to(at::kFloat), b.to(at::kFloat)));
  } else if (out.is_contiguous()) {
    at::bmm_out(const_cast<at::Tensor&>(out), a, b);
  } else {
    out.copy_(at::bmm(a, b));
  }
}

}  // namespace smp::hooks::detail
