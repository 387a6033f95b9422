// Built-in communication hooks, the C++ counterparts of
// torch.distributed.algorithms.ddp_comm_hooks.default_hooks (API.md §Communication
// hooks). Each returns a CommHook for Reducer::register_comm_hook; `state` is the
// process group to reduce over (null: the reducer's own group, bucket.process_group()).
//
// All of them average: they divide by the group size before summing, so the result
// equals the mean of the ranks' gradients (up to the compression's rounding).
#pragma once

#include "smp_core/comm.h"
#include "smp_core/grad_bucket.h"

namespace smp::hooks {

// Divides the buffer by the group size, then allreduces it; the buffer is the result.
CommHookPtr allreduce_hook(ProcessGroupPtr state = {});

// Casts the buffer to float16 (bfloat16), divides, allreduces, and casts the sum back
// into the buffer. Halves the bytes sent.
CommHookPtr fp16_compress_hook(ProcessGroupPtr state = {});
CommHookPtr bf16_compress_hook(ProcessGroupPtr state = {});

// Runs `inner` on a float16 (bfloat16) copy of the buffer and casts its result back
// into the original buffer, e.g. fp16_compress_wrapper(allreduce_hook()).
CommHookPtr fp16_compress_wrapper(CommHookPtr inner);
CommHookPtr bf16_compress_wrapper(CommHookPtr inner);

}  // namespace smp::hooks
