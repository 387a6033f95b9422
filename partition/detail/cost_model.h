// Cost model: the normalized cost of each unit. Internal to partition/.
#pragma once

#include <vector>

#include "partition/detail/module_tree.h"
#include "partition/partition.h"

namespace smp::partition::detail {

// Note [Cost model]
// Each node's own memory and compute go to one cost item: a node inside a unit to
// that unit; the root's own parameters and code to the root (always partition 0); a
// non-root container's own code (glue between its children) to the first unit of
// its subtree in execution order. Per node:
//   memory  = param_memory_factor * param_bytes (weight, gradient and optimizer state
//             per parameter byte: Options)
//             + activation_memory_factor * (mem_bytes when memory was measured, else
//               activation_bytes; units only: a container's outputs are its last
//               child's outputs)
//   compute = time_ms when time was measured,
//             else param_bytes * calls + activation_bytes (units only)
// "Measured" is decided once for the whole trace: every called node carries a value
// (mixing ms and bytes across units would make the balance meaningless). Memory and
// compute are each divided by their total over all items (a zero total falls back to
// "every called unit weighs the same"), then cost = w * memory + (1 - w) * compute,
// w = memory_weight, so the costs sum to 1. Sums run in node order: deterministic.
struct UnitCosts {
  // Per node, as Plan::node_cost.
  std::vector<double> cost;
  // Compute came from measured time_ms (else from the size estimate).
  bool timed = false;
  // Memory came from measured mem_bytes (else from activation_bytes).
  bool memory_measured = false;
};

UnitCosts unit_costs(const std::vector<ModuleNode>& nodes, const ModuleTree& tree,
                     const Options& opts);

}  // namespace smp::partition::detail
