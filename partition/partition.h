// smp auto-partitioner: the traced module tree + a cost model -> the partition
// (pipeline stage) of every module. Pure C++: no torch, no communication.
//
// make_plan() is a pure function of its arguments: equal input gives an equal Plan,
// bit for bit, on every rank and every run (no hash-map order, fixed summation order,
// integer arithmetic in the optimizer). See docs/partitioning.md for the rules.
//
// Thread-safety: every function here is reentrant; a Plan is a plain value.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace smp::partition {

// A bad trace or bad partitioning setting. Messages start "smp: partition: " and
// name the module, the setting, its value and what is allowed.
class PartitionError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// One module of the traced tree. Nodes come in pre-order (node 0 is the root, a
// parent precedes its children, siblings in registration order).
struct ModuleNode {
  // Dotted path from the root ("" for the root, "layers.3.attn"); unique in the tree.
  std::string name;
  // Index of the parent node; -1 for the root and only for the root.
  int parent = -1;
  // Bytes of parameters and buffers owned directly by this module (not its children).
  int64_t param_bytes = 0;
  // Bytes of this module's outputs, summed over its calls in the trace.
  int64_t activation_bytes = 0;
  // Measured forward time in ms, children excluded, summed over calls; < 0: not measured.
  double time_ms = -1;
  // Measured memory increase of its forward in bytes, children excluded (inclusive
  // minus the children's), summed over calls; < 0: not measured.
  int64_t mem_bytes = -1;
  // Position of its first call in the trace's execution order; -1: never called.
  int first_call = -1;
  // Number of calls in the trace (> 1 when a module is reused); 0 iff first_call = -1.
  int calls = 0;
  // Partition from the innermost smp.partition(i) around its creation; -1: none.
  int manual_partition = -1;
  // Placed on its parent's partition whatever the balance says: the parent's forward
  // uses this module's tensors directly (a tensor-parallel block's slices, Note
  // [Blocks stay whole] in partition.cpp).
  bool follow_parent = false;
};

struct Options {
  // Number of pipeline stages (config `partitions`), >= 1.
  int partitions = 1;
  // Weight of memory balance vs compute balance, in [0, 1] (config `memory_weight`;
  // smp's config resolves it from `optimize`: 0.2 for "speed", 0.8 for "memory").
  double memory_weight = 0.2;
  // Bytes of training state per parameter byte held by a stage: the weight, its
  // gradient and the optimizer's state tensors (divided by dp when the optimizer state
  // is sharded), > 0. Default 2 (weight and gradient: the optimizer is not known).
  // smp sets it from the optimizer under optimize="memory" (Note [Cost model]).
  double param_memory_factor = 2.0;
  // Bytes of activations per traced activation byte (the microbatches a stage holds
  // at once under optimize="memory"), > 0.
  double activation_memory_factor = 1.0;
  // false: smp.partition() placements and default_partition decide (no cost model).
  bool auto_partition = true;
  // Partition of modules created outside any smp.partition() (auto_partition=false).
  int default_partition = 0;
  // Accept a bottleneck up to (1 + balance_slack) x the optimum when that lets cuts
  // fall at shallower tree depth (e.g. between blocks, not inside one); >= 0.
  // 0 keeps the plan exactly optimal (ties only). See Note [Tie-break].
  double balance_slack = 0.0;
};

// The result: every node's partition, plus what the decision was based on.
struct Plan {
  // Partition of every node (same indexing as the input). The root is always 0.
  std::vector<int> assignment;
  // Normalized cost of each unit root: its whole subtree, plus the glue code of the
  // containers it is the first unit of (a never-called unit keeps its own entry). For
  // a root that is a container: its own parameters and code, which stay on partition
  // 0. 0 for other nodes. Sums to 1. See docs/partitioning.md, "Cost model".
  std::vector<double> node_cost;
  // Unit root of every node (the node itself for a unit root); -1 for containers.
  std::vector<int> unit;
  // Called unit roots in execution order: the sequence that is cut into stages.
  std::vector<int> unit_order;
  // Total cost of each partition (sum of node_cost over the nodes it holds).
  std::vector<double> stage_cost;
  // Parameter and buffer bytes each partition holds.
  std::vector<int64_t> stage_param_bytes;
  // Estimated training-state and activation bytes per stage: param_memory_factor x
  // parameter bytes + activation_memory_factor x traced activation bytes (Options).
  std::vector<double> stage_memory_bytes;
  // Tree depth of the lowest common ancestor of the two units at each stage
  // boundary (partitions - 1 entries; empty with auto_partition=false).
  std::vector<int> cut_depth;
  // Deterministic 64-bit FNV-1a hash of (partitions, sorted (name, partition)
  // pairs): equal on ranks that computed the same mapping.
  uint64_t hash = 0;

  // Readable table: one row per module (indented name, kind, partition, params,
  // cost), then one row per partition with its totals.
  std::string table(const std::vector<ModuleNode>& nodes) const;
};

// Computes the plan. Throws PartitionError for a malformed tree (empty, bad parent
// index, negative size, duplicate name), bad options, a manual placement out of
// range, or more partitions than the model has partitionable modules.
Plan make_plan(const std::vector<ModuleNode>& nodes, const Options& opts);

// One line per unit, in execution order then never-called units, for debugging:
// "unit 3: layers.1 (4 modules, first call 12, 2 calls, params 8.0 MiB)".
std::vector<std::string> describe_units(const std::vector<ModuleNode>& nodes);

}  // namespace smp::partition
