// Hooks for measuring and debugging (torch's ddp_comm_hooks.debugging_hooks).
#pragma once

#include "smp_core/grad_bucket.h"

namespace smp::hooks {

// Returns the buffer unreduced: no communication at all. Measures the cost of
// everything but the allreduce; the gradients stay local.
CommHookPtr noop_hook();

}  // namespace smp::hooks
