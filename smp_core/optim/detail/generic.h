// The fused optimizers' device-generic steps (internal; included only from
// smp_core/optim/*.cpp and their tests): the updates of lamb.h and novograd.h written
// with ATen ops, for tensors on any device (CUDA included). lamb_step and novograd_step
// call them for tensors that are not all on the CPU (Note [Device-generic steps] in
// generic.cpp).
//
// Threads and streams: the ops are queued on each tensor's device (CUDA: the current
// stream) and the functions return when they are queued, not done; they read .item()
// of nothing on a device. The caller's tensors are updated in place, in stream order.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/optim/lamb.h"
#include "smp_core/optim/novograd.h"

namespace smp::optim::detail {

// The environment variable that makes CPU tensors take the device-generic path too
// (set to anything but "" or "0"), for tests that compare the two paths on the CPU.
constexpr const char* kGenericEnv = "SMP_OPTIM_GENERIC";

// Whether a step of `tensors` takes the device-generic path: one of them is not on the
// CPU, or kGenericEnv is set. Read at every call.
bool use_generic(const std::vector<at::Tensor>& tensors);

// `value` as a 0-d float64 CPU tensor.
at::Tensor host_scalar(double value);

// lamb_step (lamb.h) by ATen ops. `global_grad_norm`: a one-element tensor on any
// device (a CPU one is read on the host; a device one stays there).
void lamb_step_generic(const std::vector<at::Tensor>& params,
                       const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs,
                       const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<int64_t>& steps, const at::Tensor& global_grad_norm,
                       const LambOptions& options);

// novograd_step (novograd.h) by ATen ops.
void novograd_step_generic(const std::vector<at::Tensor>& params,
                           const std::vector<at::Tensor>& grads,
                           const std::vector<at::Tensor>& exp_avgs,
                           const std::vector<at::Tensor>& grad_norms,
                           const std::vector<int64_t>& steps, const NovoGradOptions& options);

// sum_of_squares_tensor (norms.h) by ATen ops: a 0-d float64 tensor on the first
// tensor's device (the CPU for none).
at::Tensor sum_of_squares_generic(const std::vector<at::Tensor>& tensors);

}  // namespace smp::optim::detail
