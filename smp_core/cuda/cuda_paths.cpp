// Compiled only when the torch found has CUDA (smp_core/CMakeLists.txt, SMP_WITH_CUDA):
// the CUDA-specific pieces of smp's GPU path, and the names build_info() reports, so a
// test can tell that a CUDA torch really got smp's CUDA path compiled and linked
// (tests/python/test_build_info.py). No GPU is needed to compile or link this.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <string>
#include <vector>

namespace smp::device::cuda {

// The CUDA stream the calling thread queues work on for `device_index`: the stream
// StreamPoint records on (autograd's thread) and blocks (the comm thread).
int64_t current_stream_id(c10::DeviceIndex device_index) {
  return c10::cuda::getCurrentCUDAStream(device_index).id();
}

// GPUs this process sees (0 here: no GPU; the call links against libc10_cuda).
int device_count() { return static_cast<int>(c10::cuda::device_count()); }

bool nccl_compiled() {
#if defined(USE_C10D_NCCL)
  return true;
#else
  return false;
#endif
}

std::vector<std::string> compiled_paths() {
  std::vector<std::string> paths = {
      "cuda_streams",           // StreamPoint on CUDA streams (reducer: bucket -> comm thread)
      "cuda_record_stream",     // caching-allocator recordStream for buckets crossing threads
      "cuda_tensors_p2p",       // CUDA tensors through the pipeline by c10d send/recv
      "cuda_map_location",      // checkpoints loaded onto/off CUDA devices
  };
  if (nccl_compiled()) paths.push_back("nccl_groups");  // backend "nccl" (c10d ProcessGroupNCCL)
  return paths;
}

}  // namespace smp::device::cuda
