#include "smp_core/fingerprint.h"

#include <torch/torch.h>
#include <xxhash.h>

namespace smp {

uint64_t fingerprint(const at::Tensor& t) {
  at::Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
  return XXH3_64bits(c.data_ptr(), c.numel() * c.element_size());
}

}  // namespace smp
