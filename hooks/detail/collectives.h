// Collectives the hooks share. Included only from hooks/*.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include "smp_core/comm.h"
#include "smp_core/grad_bucket.h"

namespace smp::hooks::detail {

// Sums `t` in place over `pg`; the future's value is `t`. Gloo in torch 1.13 has no
// bfloat16 arithmetic, so bfloat16 on Gloo goes as an allgather of the raw 16-bit
// values (same bytes per rank as a ring allreduce for two ranks) summed in float32
// and rounded back once. The summation runs in the allgather's completion callback:
// local arithmetic only, no collective (see Note [Ordered bucket communication]).
FuturePtr allreduce_sum(const ProcessGroupPtr& pg, const at::Tensor& t);

}  // namespace smp::hooks::detail
