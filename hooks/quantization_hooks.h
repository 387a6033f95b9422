// Quantizing comm hooks, the counterparts of torch.distributed.algorithms.
// ddp_comm_hooks.quantization_hooks: each rank quantizes its bucket to uint8 with its
// own affine scale and zero point (those of torch's MinMaxObserver /
// PerChannelMinMaxObserver), the ranks allgather the uint8 tensors, and each rank
// dequantizes every rank's part and averages. The arithmetic is torch's, op for op, so
// the result is bit-identical to torch's hooks where those run (torch's call .cuda()
// and so run on CUDA only; ours run on any device).
//
// Each bucket costs two allgathers, issued in this order from run(): the (scale, zero
// point) pairs, then (after waiting for them, bounded by `timeout_s`) the quantized
// tensor. torch's hooks issue the second from a completion callback; these never do
// (Note [Ordered bucket communication] in smp_core/comm_queue.h). Dequantization runs
// in result().
#pragma once

#include <cstdint>

#include "smp_core/comm.h"
#include "smp_core/grad_bucket.h"

namespace smp::hooks {

// One scale and zero point for the whole bucket. `state`: the group (null: the
// bucket's).
CommHookPtr quantization_pertensor_hook(ProcessGroupPtr state = {}, double timeout_s = 300.0);

// The bucket zero-padded to channels of `channel_size` elements (torch's `bucket_size`
// argument, default 512; as torch, a bucket whose length is a multiple of it gets
// one extra all-zero channel), with a scale and zero point per channel. Throws
// ConfigError if channel_size < 1.
CommHookPtr quantization_perchannel_hook(ProcessGroupPtr state = {}, int64_t channel_size = 512,
                                         double timeout_s = 300.0);

}  // namespace smp::hooks
