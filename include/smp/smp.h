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
// Headers of libraries still being built are included when present (`__has_include`),
// so this header compiles from the source tree, a build tree or an install tree at
// any stage. Installed layout: <prefix>/include/smp/{smp.h, smp_core/, partition/,
// hooks/, checkpoint/}; the targets smp::core etc. put both <prefix>/include and
// <prefix>/include/smp on the include path, so the inner "smp_core/..." includes
// resolve.
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

// Parts that land as they are written.
#if defined(__has_include)
#if __has_include("smp_core/comm_queue.h")
#include "smp_core/comm_queue.h"
#endif
#if __has_include("smp_core/grad_bucket.h")
#include "smp_core/grad_bucket.h"
#endif
#if __has_include("smp_core/reducer.h")
#include "smp_core/reducer.h"
#endif
#if __has_include("smp_core/join.h")
#include "smp_core/join.h"
#endif
#if __has_include("smp_core/distributed_model.h")
#include "smp_core/distributed_model.h"
#endif
#if __has_include("hooks/builtin.h")
#include "hooks/builtin.h"
#endif
#if __has_include("hooks/default_hooks.h")
#include "hooks/default_hooks.h"
#endif
#if __has_include("hooks/powersgd.h")
#include "hooks/powersgd.h"
#endif
#if __has_include("hooks/debugging_hooks.h")
#include "hooks/debugging_hooks.h"
#endif
#if __has_include("checkpoint/checkpoint.h")
#include "checkpoint/checkpoint.h"
#endif
#endif  // __has_include

