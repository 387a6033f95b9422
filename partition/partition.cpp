#include "partition/partition.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "partition/detail/cost_model.h"
#include "partition/detail/linear_partition.h"
#include "partition/detail/module_tree.h"
#include "smp_common/hash.h"

namespace smp::partition {
namespace {

using detail::fail;

// Costs enter the optimizer as integers (units of 2^-40 of the model's total), so
// that ties are exact and every rank sees the same comparisons.
constexpr double kCostScale = 1099511627776.0;  // 2^40

using smp::common::fnv1a;
using smp::common::kFnvOffset;

void validate_options(const Options& o) {
  if (o.partitions < 1) fail("'partitions'=", o.partitions, " is not allowed (must be >= 1)");
  if (!(o.memory_weight >= 0.0 && o.memory_weight <= 1.0)) {
    fail("'memory_weight'=", o.memory_weight, " is not in [0, 1]");
  }
  if (!(o.param_memory_factor > 0.0) || !std::isfinite(o.param_memory_factor)) {
    fail("'param_memory_factor'=", o.param_memory_factor, " is not allowed (must be finite and > 0)");
  }
  if (!(o.activation_memory_factor > 0.0) || !std::isfinite(o.activation_memory_factor)) {
    fail("'activation_memory_factor'=", o.activation_memory_factor,
         " is not allowed (must be finite and > 0)");
  }
  if (!(o.balance_slack >= 0.0) || !std::isfinite(o.balance_slack)) {
    fail("'balance_slack'=", o.balance_slack, " is not allowed (must be finite and >= 0)");
  }
}

void check_partition_index(const std::vector<ModuleNode>& nodes, int i, int partitions) {
  const int p = nodes[i].manual_partition;
  if (p < -1 || p >= partitions) {
    fail("module '", detail::display_name(nodes[i].name), "' is placed in smp.partition(", p,
         ") but partitions=", partitions, " (allowed 0..", partitions - 1, ")");
  }
}

// auto_partition=false: SMP v1 rules. The Python side has already resolved nested
// smp.partition() contexts (innermost wins), so manual_partition is final per node.
std::vector<int> manual_assignment(const std::vector<ModuleNode>& nodes, const Options& o) {
  if (o.default_partition < 0 || o.default_partition >= o.partitions) {
    fail("'default_partition'=", o.default_partition, " is not a partition (allowed 0..",
         o.partitions - 1, " with partitions=", o.partitions, ")");
  }
  std::vector<int> a(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    check_partition_index(nodes, static_cast<int>(i), o.partitions);
    a[i] = nodes[i].manual_partition >= 0 ? nodes[i].manual_partition : o.default_partition;
  }
  a[0] = 0;  // the root is the driver's; see Note [Containers]
  return a;
}

// Note [Containers]
// Units are placed by the optimizer. A container whose units all landed in one
// partition goes there too (its caller then makes one remote call); a container
// spanning several partitions stays with its parent, from where it orchestrates the
// calls. The root always stays on partition 0, the driver that runs the step.
std::vector<int> auto_assignment(const std::vector<ModuleNode>& nodes,
                                 const detail::ModuleTree& tree, const detail::UnitCosts& costs,
                                 const Options& o, std::vector<int>* cut_depth) {
  const int n = static_cast<int>(nodes.size());
  const int m = static_cast<int>(tree.order.size());
  if (m < o.partitions && o.partitions > 1) {  // one partition takes any tree
    fail(o.partitions, " stages but only ", m, " partitionable modules (", m, " < ", o.partitions,
         ")");
  }
  std::vector<int> position(n, -1);
  for (int k = 0; k < m; ++k) position[tree.order[k]] = k;

  std::vector<int64_t> weight(m, 0);
  auto quantize = [](double c) { return static_cast<int64_t>(std::llround(c * kCostScale)); };
  for (int u : tree.units) {
    if (tree.host[u] >= 0) weight[position[tree.host[u]]] += quantize(costs.cost[u]);
  }
  // The root's own cost rides with the first unit, which always lands on partition 0.
  if (tree.unit[0] < 0 && m > 0) weight[0] += quantize(costs.cost[0]);

  std::vector<int> a(n, 0);
  if (m > 0) {
    std::vector<int> penalty(m, 0);
    for (int k = 1; k < m; ++k) {
      penalty[k] = detail::lca_depth(tree, nodes, tree.order[k - 1], tree.order[k]);
    }
    const detail::LinearSplit split =
        detail::split_contiguous(weight, penalty, o.partitions, o.balance_slack);
    for (int k = 1; k < m; ++k) {
      if (split.stage[k] != split.stage[k - 1]) cut_depth->push_back(penalty[k]);
    }
    for (int i = 0; i < n; ++i) {
      const int u = tree.unit[i];
      if (u >= 0) a[i] = split.stage[position[tree.host[u]]];
    }
  }

  // Span of each container's units, bottom-up (children have larger indices).
  std::vector<int> lo(n, std::numeric_limits<int>::max()), hi(n, -1);
  for (int i = n - 1; i >= 0; --i) {
    if (tree.unit[i] >= 0) lo[i] = hi[i] = a[i];
    const int p = nodes[i].parent;
    if (i > 0 && tree.unit[p] < 0) {
      lo[p] = std::min(lo[p], lo[i]);
      hi[p] = std::max(hi[p], hi[i]);
    }
  }
  for (int i = 0; i < n; ++i) {
    if (tree.unit[i] >= 0) continue;
    a[i] = i == 0 ? 0 : (lo[i] == hi[i] ? lo[i] : a[nodes[i].parent]);
  }
  return a;
}


uint64_t fnv1a_int(uint64_t h, int64_t v) {
  unsigned char bytes[8];
  for (int k = 0; k < 8; ++k)
    bytes[k] = static_cast<unsigned char>(static_cast<uint64_t>(v) >> (8 * k));
  return fnv1a(h, bytes, 8);
}

// Over (partitions, node count, (name, partition) sorted by name): independent of
// the order siblings were registered in, and of byte order.
uint64_t plan_hash(const std::vector<ModuleNode>& nodes, const std::vector<int>& a, int s) {
  std::vector<int> by_name(nodes.size());
  std::iota(by_name.begin(), by_name.end(), 0);
  std::sort(by_name.begin(), by_name.end(),
            [&](int x, int y) { return nodes[x].name < nodes[y].name; });
  uint64_t h = fnv1a_int(kFnvOffset, s);
  h = fnv1a_int(h, static_cast<int64_t>(nodes.size()));
  for (int i : by_name) {
    h = fnv1a(h, nodes[i].name.data(), nodes[i].name.size() + 1);  // with the '\0'
    h = fnv1a_int(h, a[i]);
  }
  return h;
}

}  // namespace

Plan make_plan(const std::vector<ModuleNode>& nodes, const Options& opts) {
  validate_options(opts);
  const detail::ModuleTree tree = detail::build_tree(nodes);
  const detail::UnitCosts costs = detail::unit_costs(nodes, tree, opts);

  Plan plan;
  plan.assignment = opts.auto_partition ? auto_assignment(nodes, tree, costs, opts, &plan.cut_depth)
                                        : manual_assignment(nodes, opts);
  // Note [Blocks stay whole]: a module whose parent computes with its tensors directly
  // (not by calling it) must live where the parent runs; smp.nn's distributed blocks
  // mark their parts so (their layer norms, their slices of a linear map, the LM
  // head's embeddings). Parents precede their children, so a chain resolves in order.
  for (size_t i = 0; i < nodes.size(); ++i)
    if (nodes[i].follow_parent && nodes[i].parent >= 0)
      plan.assignment[i] = plan.assignment[nodes[i].parent];
  plan.node_cost = costs.cost;
  plan.unit = tree.unit;
  plan.unit_order = tree.order;
  plan.stage_cost.assign(opts.partitions, 0.0);
  plan.stage_param_bytes.assign(opts.partitions, 0);
  plan.stage_memory_bytes.assign(opts.partitions, 0.0);
  for (size_t i = 0; i < nodes.size(); ++i) {
    plan.stage_cost[plan.assignment[i]] += plan.node_cost[i];
    plan.stage_param_bytes[plan.assignment[i]] += nodes[i].param_bytes;
    // Activations count in units only (a container returns its last child's output).
    const bool in_unit = tree.unit[i] >= 0;
    const double acts = in_unit ? static_cast<double>(std::max<int64_t>(nodes[i].activation_bytes, 0))
                                : 0.0;
    plan.stage_memory_bytes[plan.assignment[i]] +=
        opts.param_memory_factor * static_cast<double>(nodes[i].param_bytes) +
        opts.activation_memory_factor * acts;
  }
  plan.hash = plan_hash(nodes, plan.assignment, opts.partitions);
  return plan;
}

}  // namespace smp::partition
