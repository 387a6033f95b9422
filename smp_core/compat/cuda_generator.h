// torch-version difference: reaching the default CUDA generator of a device.
// torch 1.13 names it CUDAHooksInterface::getDefaultCUDAGenerator; torch 2.x moved it to
// the accelerator hooks' getDefaultGenerator. Part of smp_core/compat/ (torch_compat.h).
#pragma once

#include <cstdint>

#include <ATen/core/Generator.h>

namespace smp::compat {

// The default CUDA generator of `device` (-1: the current device). Needs a CUDA torch
// (at::globalContext().hasCUDA()).
const at::Generator& default_cuda_generator(int64_t device);

}  // namespace smp::compat
