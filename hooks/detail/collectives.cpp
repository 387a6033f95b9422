#include "hooks/detail/collectives.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace smp::hooks::detail {

FuturePtr allreduce_sum(const ProcessGroupPtr& pg, const at::Tensor& t) {
  // Nothing to send (the same on every rank: same layout). Gloo's allgather of empty
  // tensors dies with SIGFPE.
  if (t.numel() == 0) return completed_future(t);
  if (t.scalar_type() != at::kBFloat16 || pg->getBackendName() != "gloo")
    return allreduce_flat(pg, t);
  const int n = pg->getSize();
  std::vector<at::Tensor> in{t.view(at::kHalf)};  // bits only: nothing adds in fp16
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < n; ++r) out[0].push_back(at::empty_like(in[0]));
  auto fut = pg->allgather(out, in)->getFuture();
  return fut->then(
      [t, parts = out[0]](c10::ivalue::Future& f) -> c10::IValue {
        if (f.hasError()) std::rethrow_exception(f.exception_ptr());
        at::Tensor acc = parts[0].view(at::kBFloat16).to(at::kFloat);
        for (size_t r = 1; r < parts.size(); ++r) acc.add_(parts[r].view(at::kBFloat16));
        t.copy_(acc);
        return t;
      },
      c10::TensorType::get());
}

}  // namespace smp::hooks::detail
