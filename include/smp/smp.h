// smp C++ API: one include for libtorch programs. See docs/cpp_api.md.
//
//   #include <smp/smp.h>
//   smp::Runtime& rt = smp::init(R"({"partitions": 1, "ddp": true})");
//
// Everything lives in namespace smp (the partitioner in smp::partition). This header
// pulls in no <torch/torch.h>: the smp_core headers forward-declare c10d types and
// include only small c10/ATen headers, so a consumer pays for torch's big headers only
// if it includes them itself.
//
// The list below is fixed: every header it names is installed (tests/python/
// test_install.py checks each one and compiles a consumer against them), so the public
// API never shrinks silently. Installed layout: <prefix>/include/smp/{smp.h,
// smp_core/, partition/, hooks/, checkpoint/}; the targets smp::core etc. put both
// <prefix>/include and <prefix>/include/smp on the include path, so the inner
// "smp_core/..." includes resolve.
#pragma once

// Errors: ConfigError (bad setting), CommError, TimeoutError; SMP_CHECK.
#include "smp_core/errors.h"
// Config: the keys of smp.init(config), parsed and validated.
#include "smp_core/config.h"
// Topology: rank layout (pp x dp) as SMP v1 maps it.
#include "smp_core/topology.h"
// Byte collectives and buffered store-based point-to-point messages.
#include "smp_core/comm.h"
// smp::init / runtime(): config agreement, store and process groups.
#include "smp_core/runtime.h"
// Pipeline message transport (microbatch, call id, kind) and compute token.
#include "smp_core/p2p.h"
// Auto-partitioner: module tree + cost model -> partition of every module.
#include "partition/partition.h"

// Gradient reduction: the ordered comm queue, buckets and comm hooks, the reducer.
#include "smp_core/comm_queue.h"
#include "smp_core/grad_bucket.h"
#include "smp_core/reducer.h"
// Join: the collectives of training with uneven inputs.
#include "smp_core/join.h"
// DistributedModel: a libtorch module trained with data parallelism.
#include "smp_core/distributed_model.h"
// Built-in comm hooks: by type or name, allreduce and fp16/bf16, PowerSGD, noop.
#include "hooks/builtin.h"
#include "hooks/default_hooks.h"
#include "hooks/powersgd.h"
#include "hooks/debugging_hooks.h"
// Checkpoints: atomic, verified files.
#include "checkpoint/checkpoint.h"
// Fused optimizers: apex's LAMB and NovoGrad steps over a parameter group, and norms
// over many tensors (the kernels of smp.optimizers).
#include "smp_core/optim/lamb.h"
#include "smp_core/optim/norms.h"
#include "smp_core/optim/novograd.h"
