#include "partition/detail/cost_model.h"

#include <algorithm>

namespace smp::partition::detail {
namespace {

// The cost item each node's own memory and compute go to. See Note [Cost model].
std::vector<int> charge_targets(const std::vector<ModuleNode>& nodes, const ModuleTree& tree) {
  const int n = static_cast<int>(nodes.size());
  std::vector<int> target(n, -1);
  target[0] = 0;
  for (int i = 0; i < n; ++i) {
    if (tree.unit[i] >= 0) target[i] = tree.unit[i];
  }
  // Containers: first claimed by the earliest called unit below them, then (for
  // subtrees nothing in which was called) by the first unit below them in pre-order.
  auto claim = [&](int u) {
    for (int a = nodes[u].parent; a > 0 && target[a] < 0; a = nodes[a].parent) target[a] = u;
  };
  for (int u : tree.order) claim(u);
  for (int u : tree.units) claim(u);
  return target;
}

}  // namespace

UnitCosts unit_costs(const std::vector<ModuleNode>& nodes, const ModuleTree& tree,
                     const Options& opts) {
  const double memory_weight = opts.memory_weight;
  const int n = static_cast<int>(nodes.size());
  UnitCosts out;
  out.timed = tree.traced;
  out.memory_measured = tree.traced;
  for (const ModuleNode& m : nodes) {
    if (m.calls == 0) continue;
    if (m.time_ms < 0) out.timed = false;
    if (m.mem_bytes < 0) out.memory_measured = false;
  }

  const std::vector<int> target = charge_targets(nodes, tree);
  std::vector<double> mem(n, 0.0), comp(n, 0.0);
  double mem_total = 0.0, comp_total = 0.0;
  for (int i = 0; i < n; ++i) {
    const ModuleNode& m = nodes[i];
    const bool in_unit = tree.unit[i] >= 0;
    const double params = static_cast<double>(m.param_bytes);
    const double acts = in_unit ? static_cast<double>(m.activation_bytes) : 0.0;
    double mi = opts.param_memory_factor * params;
    mi += opts.activation_memory_factor *
          (out.memory_measured ? static_cast<double>(std::max<int64_t>(m.mem_bytes, 0)) : acts);
    double ci;
    if (out.timed) {
      ci = std::max(m.time_ms, 0.0);
    } else {
      // Untraced trees have no call counts: count every module once.
      const double calls = tree.traced ? static_cast<double>(m.calls) : 1.0;
      ci = params * calls + acts;
    }
    mem[target[i]] += mi;
    comp[target[i]] += ci;
    mem_total += mi;
    comp_total += ci;
  }

  const double uniform = tree.order.empty() ? 0.0 : 1.0 / static_cast<double>(tree.order.size());
  out.cost.assign(n, 0.0);
  for (int i = 0; i < n; ++i) {
    const bool called_unit = tree.unit[i] == i && tree.unit_first[i] >= 0;
    const double fm = mem_total > 0 ? mem[i] / mem_total : (called_unit ? uniform : 0.0);
    const double fc = comp_total > 0 ? comp[i] / comp_total : (called_unit ? uniform : 0.0);
    out.cost[i] = memory_weight * fm + (1.0 - memory_weight) * fc;
  }
  return out;
}

}  // namespace smp::partition::detail
