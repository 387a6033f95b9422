// NovoGrad (Ginsburg et al. 2019, "Stochastic Gradient Methods with Layer-wise Adaptive
// Moments for Training of Deep Networks", arXiv:1905.11286; used by Jasper,
// arXiv:1904.03288) as apex's FusedNovoGrad computes it, over a whole parameter group
// in one multi-tensor pass (Note [Fused optimizer kernels] in
// optim/detail/multi_tensor.h). smp.optimizers.FusedNovoGrad (python/smp/optimizers.py)
// is its Python face.
//
// The second moment is one number per tensor, a running average of the gradient's
// norm (Note [NovoGrad step] in novograd.cpp for the whole update). Cost: the norms'
// pass reads each gradient, the update reads gradient, parameter and m and writes
// parameter and m: 24 bytes of memory traffic per fp32 parameter, AdamW's 28.
//
// Devices: CPU tensors are stepped by the kernel (novograd.cpp); a group with a tensor
// on another device (CUDA, ...) by the same update in ATen ops (Note [Device-generic
// steps] in generic.cpp), as is every group when SMP_OPTIM_GENERIC=1.
// Threads: on the CPU, novograd_step runs on torch's intra-op threads and returns when
// done; elsewhere it returns when the ops are queued on the tensors' streams. It reads
// the gradients and writes parameters and state in place; nothing else may touch them
// meanwhile. The result does not depend on the number of threads.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace smp::optim {

// The per-tensor gradient norm NovoGrad averages (apex's norm_type 2 and 0).
enum class NovoGradNorm { kL2 = 2, kInf = 0 };

// apex FusedNovoGrad's arguments and defaults (apex/optimizers/fused_novograd.py).
struct NovoGradOptions {
  // Learning rate (>= 0).
  double lr = 1e-3;
  // Decay rates of the moment m and of the norm average v (each in [0, 1)).
  double beta1 = 0.9;
  double beta2 = 0.999;
  // Added to the denominator v (>= 0).
  double eps = 1e-8;
  // Weight decay (>= 0), added to the normalized gradient (reg_inside_moment) or to the
  // update.
  double weight_decay = 0;
  // Divide m by (1 - beta1^step) and v by sqrt(1 - beta2^step).
  bool bias_correction = true;
  // Scale the normalized gradient's share of m by (1 - beta1) (else 1).
  bool grad_averaging = true;
  // Normalize the gradient and add the weight decay before the moment (the paper's
  // form, apex's moment mode 0) rather than in the update (mode 1).
  bool reg_inside_moment = false;
  // Which norm of each gradient v averages.
  NovoGradNorm norm_type = NovoGradNorm::kL2;
  // Start v at 0 (else at the first step's norm, so that the first average is it).
  bool init_zero = false;
};

// Throws smp::ConfigError naming the first option out of its range.
void validate(const NovoGradOptions& options);

// One NovoGrad step of a parameter group. params[i] and grads[i]: the same shape and
// dtype (fp32, fp16 or bf16) on one device, any strides; exp_avgs[i]: fp32,
// contiguous, params[i].numel() elements; grad_norms[i]: a one-element fp32 tensor, v
// of params[i] (both on params[i]'s device, updated in place); steps[i]: the number of this step for params[i] (1 on its
// first: v starts there). Throws std::runtime_error on mismatched lists, shapes, dtypes
// or devices, and smp::ConfigError on bad options.
void novograd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& exp_avgs,
                   const std::vector<at::Tensor>& grad_norms, const std::vector<int64_t>& steps,
                   const NovoGradOptions& options);

}  // namespace smp::optim
