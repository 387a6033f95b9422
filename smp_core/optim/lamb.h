// LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in
// 76 minutes", arXiv:1904.00962) as apex's FusedLAMB computes it, over a whole
// parameter group in one multi-tensor pass (Note [Fused optimizer kernels] in
// optim/detail/multi_tensor.h). smp.optimizers.FusedLamb (python/smp/optimizers.py)
// is its Python face.
//
// Per element, with g the gradient divided by the clipping factor (Note [LAMB step] in
// lamb.cpp for the whole update):
//   m = beta1 m + beta3 g          (beta3 = 1 - beta1 with grad_averaging, else 1)
//   v = beta2 v + (1 - beta2) g^2
//   u = (m / bc1) / (sqrt(v / bc2) + eps)  [+ weight_decay p with adam_w_mode]
//   p = p - lr * trust_ratio * u,  trust_ratio = ||p|| / ||u|| per tensor.
// Cost: two passes over each tensor (the ratio needs its norms first), and the global
// norm's (the caller's) over the gradients: 44 bytes of memory traffic per fp32
// parameter against AdamW's 28 (Note [LAMB step]).
//
// Devices: CPU tensors are stepped by the kernel (lamb.cpp); a group with a tensor on
// another device (CUDA, ...) by the same update in ATen ops (Note [Device-generic
// steps] in generic.cpp), as is every group when SMP_OPTIM_GENERIC=1.
// Threads: on the CPU, lamb_step runs on torch's intra-op threads and returns when
// done; elsewhere it returns when the ops are queued on the tensors' streams. It reads
// the gradients and writes parameters and state in place; nothing else may touch them
// meanwhile. The result does not depend on the number of threads.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace smp::optim {

// apex FusedLAMB's arguments and defaults (apex/optimizers/fused_lamb.py).
struct LambOptions {
  // Learning rate (>= 0).
  double lr = 1e-3;
  // Decay rates of the first and second moment averages (each in [0, 1)).
  double beta1 = 0.9;
  double beta2 = 0.999;
  // Added to sqrt(v) in the denominator (>= 0).
  double eps = 1e-6;
  // Decoupled decay (adam_w_mode) or L2 penalty added to the gradient (>= 0).
  double weight_decay = 0.01;
  // Divide m and v by (1 - beta^step).
  bool bias_correction = true;
  // Scale the gradient's share of m by (1 - beta1) (else 1).
  bool grad_averaging = true;
  // Weight decay added to the update (AdamW's) rather than to the gradient (L2).
  bool adam_w_mode = true;
  // Apply the trust ratio to tensors with no weight decay too (NVLAMB).
  bool use_nvlamb = false;
  // The global gradient norm above which gradients are scaled down to it (>= 0; 0 or
  // inf: never).
  double max_grad_norm = 1.0;
};

// Throws smp::ConfigError naming the first option out of its range.
void validate(const LambOptions& options);

// One LAMB step of a parameter group. params[i] and grads[i]: the same shape, dtype
// (fp32, fp16 or bf16) and device, any strides; exp_avgs[i], exp_avg_sqs[i]: fp32,
// contiguous, params[i].numel() elements on params[i]'s device (the state, updated in
// place); steps[i]: the number of this step for params[i] (1 on its first), for the
// bias correction. `global_grad_norm`: the L2 norm of every gradient the clipping
// covers (the caller computes it, over more than this group: every group of the
// optimizer, every rank). Throws std::runtime_error on mismatched lists, shapes, dtypes
// or devices, and smp::ConfigError on bad options.
void lamb_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs,
               const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<int64_t>& steps,
               double global_grad_norm, const LambOptions& options);

// The same with the norm as a one-element tensor (sum_of_squares_tensor's square root,
// norms.h): on a device it stays there, and the clipping is decided there, with no
// host sync; on the CPU it is read.
void lamb_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs,
               const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<int64_t>& steps,
               const at::Tensor& global_grad_norm, const LambOptions& options);

}  // namespace smp::optim
