// The local arithmetic of PowerSGD, as torch's powerSGD_hook.py does it (same ops in
// the same order, so results agree to rounding). Included only from hooks/*.cpp and
// tests.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace smp::hooks::detail {

// Whether an n x m matrix is worth compressing at `rank`:
// (n + m) * rank * min_compression_rate < n * m (torch's _should_compress).
bool should_compress(int64_t n, int64_t m, int64_t rank, double min_compression_rate);

// Orthonormalises the columns of each matrix of the batch `m` ([B, n, r], r <= n) in
// place: Gram-Schmidt for r <= 2 or 16-bit dtypes, else QR (torch's _orthogonalize).
// epsilon is added to each column norm; with 0 a zero column becomes NaN, as torch's.
void orthogonalize(const at::Tensor& m, double epsilon);

// out = bmm(a, b), into `out`'s memory. Float16 on CPU (no CPU half matmul in torch
// 1.13) is computed in float32 and rounded once.
void bmm_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

}  // namespace smp::hooks::detail
