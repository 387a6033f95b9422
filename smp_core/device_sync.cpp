#include "smp_core/device_sync.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/version.h>

namespace smp::device {

#if defined(SMP_WITH_CUDA)
namespace cuda {
// smp_core/cuda/cuda_paths.cpp: only in builds against a CUDA torch.
std::vector<std::string> compiled_paths();
bool nccl_compiled();
}  // namespace cuda
#endif

StreamPoint StreamPoint::record(const c10::Device& device) {
  StreamPoint p;
  if (device.is_cpu()) return p;
  c10::impl::VirtualGuardImpl impl(device.type());
  p.device_ = device;
  p.event_ = std::make_shared<c10::Event>(device.type());
  p.event_->record(impl.getStream(device));
  return p;
}

void StreamPoint::block_current() const {
  if (!event_) return;
  c10::impl::VirtualGuardImpl impl(device_.type());
  event_->block(impl.getStream(device_));
}

void record_current_stream(const at::Tensor& t) {
  if (!t.defined() || t.device().is_cpu()) return;
  c10::impl::VirtualGuardImpl impl(t.device().type());
  impl.recordDataPtrOnStream(t.storage().data_ptr(), impl.getStream(t.device()));
}

BuildInfo build_info() {
  BuildInfo info;
  info.torch_version = TORCH_VERSION;
#if defined(SMP_WITH_CUDA)
  info.cuda = true;
  info.nccl = cuda::nccl_compiled();
  info.cuda_paths = cuda::compiled_paths();
#endif
  return info;
}

}  // namespace smp::device
