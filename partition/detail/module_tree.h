// The validated structure of a traced module tree: children, depths, units and the
// execution order of units. Internal to partition/ (include only from .cpp files).
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "partition/partition.h"

namespace smp::partition::detail {

// Throws PartitionError("smp: partition: " + args joined with operator<<).
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  os << "smp: partition: ";
  (os << ... << args);
  throw PartitionError(os.str());
}

// Note [Units]
// A unit is an assignable atom: a non-root module that owns parameters or buffers
// directly (its forward uses them while it calls its children, so its whole subtree
// stays together), or a leaf with no such ancestor. Every other module is a container
// and is placed after the units (see partition.cpp). The root is never a unit unless
// it is the only module: it always runs on partition 0 (the driver), so its own
// parameters simply stay there while its children are free to move.
struct ModuleTree {
  // Children of each node, in input order.
  std::vector<std::vector<int>> children;
  // Depth of each node; the root has depth 0.
  std::vector<int> depth;
  // Unit root of each node (itself for a unit root); -1 for containers.
  std::vector<int> unit;
  // Unit roots in pre-order.
  std::vector<int> units;
  // First call of each unit root over its whole subtree; -1: nothing in it was called.
  std::vector<int> unit_first;
  // Called unit roots in execution order (first call, then node index).
  std::vector<int> order;
  // For each unit root: the called unit it travels with (itself when called; for a
  // never-called unit the nearest called unit before it in pre-order, else order[0]);
  // -1 when no unit was called at all.
  std::vector<int> host;
  // Some node has first_call >= 0. When nothing was traced (skip_tracing), every unit
  // counts as called and pre-order stands in for the execution order.
  bool traced = false;
};

// Validates the nodes (see make_plan's contract) and builds the tree. Throws
// PartitionError.
ModuleTree build_tree(const std::vector<ModuleNode>& nodes);

// Depth of the lowest common ancestor of nodes a and b.
int lca_depth(const ModuleTree& tree, const std::vector<ModuleNode>& nodes, int a, int b);

// "(root)" for the root's empty name, else the name.
std::string display_name(const std::string& name);

// "0 B", "512 B", "1.5 KiB", "4.0 MiB", "2.3 GiB".
std::string format_bytes(int64_t bytes);

}  // namespace smp::partition::detail
