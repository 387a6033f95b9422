#include "partition/detail/module_tree.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

namespace smp::partition::detail {
namespace {

std::string quoted(const std::vector<ModuleNode>& nodes, int i) {
  return "module '" + display_name(nodes[i].name) + "'";
}

void validate_node(const std::vector<ModuleNode>& nodes, int i) {
  const ModuleNode& n = nodes[i];
  if (i == 0 && n.parent != -1) {
    fail("node 0 ('", n.name, "') must be the root (parent -1), got parent ", n.parent);
  }
  if (i > 0 && (n.parent < 0 || n.parent >= i)) {
    fail(quoted(nodes, i), " (node ", i, ") has parent ", n.parent,
         "; nodes must come in pre-order (0 <= parent < ", i, ")");
  }
  if (n.param_bytes < 0)
    fail(quoted(nodes, i), " has param_bytes=", n.param_bytes, " (must be >= 0)");
  if (n.activation_bytes < 0) {
    fail(quoted(nodes, i), " has activation_bytes=", n.activation_bytes, " (must be >= 0)");
  }
  if (!std::isfinite(n.time_ms)) {
    fail(quoted(nodes, i), " has time_ms=", n.time_ms, " (must be finite; < 0 means not measured)");
  }
  if (n.first_call < -1) {
    fail(quoted(nodes, i), " has first_call=", n.first_call,
         " (must be >= 0, or -1 if never called)");
  }
  if (n.calls < 0) fail(quoted(nodes, i), " has calls=", n.calls, " (must be >= 0)");
  if ((n.first_call >= 0) != (n.calls > 0)) {
    fail(quoted(nodes, i), " has first_call=", n.first_call, " but calls=", n.calls,
         " (a called module has first_call >= 0 and calls >= 1; a never-called one -1 and 0)");
  }
}

void check_unique_names(const std::vector<ModuleNode>& nodes) {
  std::vector<int> by_name(nodes.size());
  std::iota(by_name.begin(), by_name.end(), 0);
  std::stable_sort(by_name.begin(), by_name.end(),
                   [&](int a, int b) { return nodes[a].name < nodes[b].name; });
  for (size_t k = 1; k < by_name.size(); ++k) {
    int a = by_name[k - 1], b = by_name[k];
    if (nodes[a].name == nodes[b].name) {
      fail("module name '", display_name(nodes[a].name), "' appears twice (nodes ", a, " and ", b,
           "); names must be unique dotted paths");
    }
  }
}

}  // namespace

ModuleTree build_tree(const std::vector<ModuleNode>& nodes) {
  if (nodes.empty()) fail("empty module tree (no nodes)");
  const int n = static_cast<int>(nodes.size());
  for (int i = 0; i < n; ++i) validate_node(nodes, i);
  check_unique_names(nodes);

  ModuleTree t;
  t.children.resize(n);
  t.depth.assign(n, 0);
  for (int i = 1; i < n; ++i) {
    t.children[nodes[i].parent].push_back(i);
    t.depth[i] = t.depth[nodes[i].parent] + 1;
  }

  // See Note [Units]. Parents precede children, so one forward pass decides.
  t.unit.assign(n, -1);
  for (int i = 0; i < n; ++i) {
    const int p = nodes[i].parent;
    if (i > 0 && t.unit[p] >= 0) {
      t.unit[i] = t.unit[p];
    } else if (t.children[i].empty() || (i > 0 && nodes[i].param_bytes > 0)) {
      t.unit[i] = i;
      t.units.push_back(i);
    }
  }

  t.unit_first.assign(n, -1);
  for (int i = 0; i < n; ++i) {
    if (nodes[i].first_call < 0) continue;
    t.traced = true;
    const int u = t.unit[i];
    if (u >= 0 && (t.unit_first[u] < 0 || nodes[i].first_call < t.unit_first[u])) {
      t.unit_first[u] = nodes[i].first_call;
    }
  }
  if (!t.traced) {
    // Untraced: registration order (pre-order) is the best guess of execution order.
    for (size_t k = 0; k < t.units.size(); ++k) t.unit_first[t.units[k]] = static_cast<int>(k);
  }

  for (int u : t.units) {
    if (t.unit_first[u] >= 0) t.order.push_back(u);
  }
  std::stable_sort(t.order.begin(), t.order.end(), [&](int a, int b) {
    return t.unit_first[a] != t.unit_first[b] ? t.unit_first[a] < t.unit_first[b] : a < b;
  });

  // Never-called units ride with the nearest called unit before them in pre-order,
  // so they never open a stage of their own nor break contiguity.
  t.host.assign(n, -1);
  int last_called = -1;
  for (int u : t.units) {
    if (t.unit_first[u] >= 0) last_called = u;
    t.host[u] = last_called;
  }
  for (int u : t.units) {
    if (t.host[u] < 0 && !t.order.empty()) t.host[u] = t.order.front();
  }
  return t;
}

int lca_depth(const ModuleTree& tree, const std::vector<ModuleNode>& nodes, int a, int b) {
  while (tree.depth[a] > tree.depth[b]) a = nodes[a].parent;
  while (tree.depth[b] > tree.depth[a]) b = nodes[b].parent;
  while (a != b) {
    a = nodes[a].parent;
    b = nodes[b].parent;
  }
  return tree.depth[a];
}

std::string display_name(const std::string& name) { return name.empty() ? "(root)" : name; }

std::string format_bytes(int64_t bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes) / 1024.0;
  int k = 0;
  while (v >= 1024.0 && k < 4) {
    v /= 1024.0;
    ++k;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f %s", v, kUnits[k]);
  return buf;
}

}  // namespace smp::partition::detail
