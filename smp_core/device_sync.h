// Stream ordering for tensors that cross threads (Note [Streams across threads]).
//
// Device-generic: built on c10's DeviceGuardImplInterface, so it compiles and runs on
// every torch (CPU builds included) and needs no CUDA header; a CUDA torch registers
// the CUDA implementation behind it at run time.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <string>
#include <vector>

namespace c10 {
class Event;
}

namespace smp::device {

// Note [Streams across threads]
// On a GPU, autograd's thread queues the gradient copies into a bucket on its current
// stream and returns at once: when the bucket is handed to the reducer's comm thread,
// the copies may not have run yet. torch DDP's reducer orders them by running its
// collective from the same stream context; smp runs hooks on another thread, so:
//   - when a bucket becomes ready, the autograd thread records a StreamPoint on the
//     current stream of the bucket's device;
//   - the comm thread makes its own current stream wait on that point before the hook
//     issues anything (NCCL's stream waits on the caller's current stream);
//   - the comm thread records the bucket's memory as in use on its stream
//     (record_current_stream), so the caching allocator does not hand that memory to
//     another tensor before the collective finished, even once the training thread
//     dropped its references.
// Tensors on the CPU need none of this: their work is done when a call returns, and a
// StreamPoint for the CPU is empty.
class StreamPoint {
 public:
  StreamPoint() = default;
  // The work queued so far on the current stream of `device` (empty for the CPU).
  static StreamPoint record(const c10::Device& device);
  // Makes the calling thread's current stream of that device wait for the point.
  void block_current() const;
  bool empty() const { return event_ == nullptr; }

 private:
  std::shared_ptr<c10::Event> event_;
  c10::Device device_{c10::kCPU};
};

// Tells the device's caching allocator that `t`'s memory is in use on the calling
// thread's current stream of t's device. No-op for CPU tensors.
void record_current_stream(const at::Tensor& t);

// What this build compiled for GPUs: CUDA/NCCL paths (smp_core/cuda/, compiled only
// when the torch found has CUDA), for smp._C.build_info() and its test.
struct BuildInfo {
  std::string torch_version;          // the torch headers this build compiled against
  bool cuda = false;                  // the torch found had CUDA: smp_core/cuda/ is built
  bool nccl = false;                  // ... and c10d's NCCL backend
  std::vector<std::string> cuda_paths;  // what smp_core/cuda/ compiled in, by name
};
BuildInfo build_info();

}  // namespace smp::device
