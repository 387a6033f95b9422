// Human-readable views of a plan and of the units of a tree (logs, debugging).
#include <algorithm>
#include <cstdio>
#include <sstream>

#include "partition/detail/module_tree.h"
#include "partition/partition.h"

namespace smp::partition {
namespace {

std::string percent(double cost) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f%%", cost * 100.0);
  return buf;
}

std::string pad_right(const std::string& s, size_t width) {
  return s.size() >= width ? s : s + std::string(width - s.size(), ' ');
}

std::string pad_left(const std::string& s, size_t width) {
  return s.size() >= width ? s : std::string(width - s.size(), ' ') + s;
}

std::string kind_of(const Plan& plan, const std::vector<int>& unit_set, size_t i) {
  if (plan.unit[i] < 0) return "container";
  if (plan.unit[i] != static_cast<int>(i)) return "in unit";
  return unit_set[i] ? "unit" : "unit, not called";
}

}  // namespace

std::string Plan::table(const std::vector<ModuleNode>& nodes) const {
  const size_t n = std::min(nodes.size(), assignment.size());
  std::vector<int> depth(n, 0), called(n, 0);
  for (size_t i = 1; i < n; ++i) {
    const int p = nodes[i].parent;
    if (p >= 0 && static_cast<size_t>(p) < i) depth[i] = depth[p] + 1;
  }
  for (int u : unit_order) {
    if (u >= 0 && static_cast<size_t>(u) < n) called[u] = 1;
  }
  std::vector<std::string> names(n);
  size_t width = 6;
  for (size_t i = 0; i < n; ++i) {
    names[i] = std::string(2 * depth[i], ' ') + detail::display_name(nodes[i].name);
    width = std::max(width, names[i].size());
  }

  std::ostringstream os;
  os << pad_right("module", width) << "  " << pad_right("kind", 16) << pad_left("partition", 9)
     << pad_left("params", 12) << pad_left("cost", 9) << "\n";
  for (size_t i = 0; i < n; ++i) {
    const bool costed = i < node_cost.size() && (i == 0 || unit[i] == static_cast<int>(i));
    std::string row = pad_right(names[i], width) + "  " + pad_right(kind_of(*this, called, i), 16) +
                      pad_left(std::to_string(assignment[i]), 9) +
                      pad_left(detail::format_bytes(nodes[i].param_bytes), 12);
    if (costed) row += pad_left(percent(node_cost[i]), 9);
    os << row << "\n";
  }

  std::vector<int> units_in(stage_cost.size(), 0), modules_in(stage_cost.size(), 0);
  for (size_t i = 0; i < n; ++i) {
    const size_t p = static_cast<size_t>(assignment[i]);
    if (p >= stage_cost.size()) continue;
    ++modules_in[p];
    if (unit[i] == static_cast<int>(i)) ++units_in[p];
  }
  os << "\n"
     << pad_left("partition", 9) << pad_left("modules", 9) << pad_left("units", 7)
     << pad_left("params", 12) << pad_left("cost", 9) << "\n";
  for (size_t p = 0; p < stage_cost.size(); ++p) {
    const int64_t params = p < stage_param_bytes.size() ? stage_param_bytes[p] : 0;
    os << pad_left(std::to_string(p), 9) << pad_left(std::to_string(modules_in[p]), 9)
       << pad_left(std::to_string(units_in[p]), 7) << pad_left(detail::format_bytes(params), 12)
       << pad_left(percent(stage_cost[p]), 9) << "\n";
  }
  return os.str();
}

std::vector<std::string> describe_units(const std::vector<ModuleNode>& nodes) {
  const detail::ModuleTree tree = detail::build_tree(nodes);
  const int n = static_cast<int>(nodes.size());
  std::vector<int> size(n, 0);
  std::vector<int64_t> params(n, 0);
  for (int i = 0; i < n; ++i) {
    const int u = tree.unit[i];
    if (u < 0) continue;
    ++size[u];
    params[u] += nodes[i].param_bytes;
  }
  std::vector<int> listed = tree.order;
  for (int u : tree.units) {
    if (tree.unit_first[u] < 0) listed.push_back(u);
  }
  std::vector<std::string> out;
  for (size_t k = 0; k < listed.size(); ++k) {
    const int u = listed[k];
    std::ostringstream os;
    os << "unit " << k << ": " << detail::display_name(nodes[u].name) << " (" << size[u]
       << (size[u] == 1 ? " module, " : " modules, ");
    if (tree.unit_first[u] < 0) {
      os << "never called, rides with '"
         << (tree.host[u] >= 0 ? detail::display_name(nodes[tree.host[u]].name) : "-") << "'";
    } else if (tree.traced) {
      os << "first call " << tree.unit_first[u] << ", " << nodes[u].calls
         << (nodes[u].calls == 1 ? " call" : " calls");
    } else {
      os << "not traced";
    }
    os << ", params " << detail::format_bytes(params[u]) << ")";
    out.push_back(os.str());
  }
  return out;
}

}  // namespace smp::partition
