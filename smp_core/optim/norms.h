// Norms over many tensors in one parallel pass (the fused optimizers' building block,
// Note [Fused optimizer kernels] in optim/detail/multi_tensor.h).
//
// Threads: runs on torch's intra-op threads (at::parallel_for) and returns when done;
// the caller may hold no lock the intra-op threads need. The result does not depend on
// the number of threads.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

namespace smp::optim {

// The sum of x^2 over every element of every tensor (CPU; fp32, fp16 or bf16, any
// strides), accumulated in fp32 lanes per chunk and in double across chunks. Throws
// std::runtime_error on another dtype or device.
double sum_of_squares(const std::vector<at::Tensor>& tensors);

// The same sum as a 0-d float64 tensor on the first tensor's device (the CPU for none),
// for tensors on any device: CPU ones by sum_of_squares, others by ATen ops that leave
// it on the device, with no host sync (Note [Device-generic steps] in generic.cpp;
// SMP_OPTIM_GENERIC=1 sends CPU tensors there too). Throws std::runtime_error on a
// dtype other than fp32, fp16 or bf16.
at::Tensor sum_of_squares_tensor(const std::vector<at::Tensor>& tensors);

}  // namespace smp::optim
