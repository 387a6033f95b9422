// Test helpers: build synthetic traced module trees the way the Python tracer would
// report them (pre-order nodes, first_call in execution order, calls counted).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "partition/partition.h"

namespace smp::partition::testing {

constexpr int64_t kMiB = 1 << 20;

// Nodes can be added in any order; build() emits them in pre-order (children in the
// order they were added). Calls are recorded in execution order with call().
class TreeBuilder {
 public:
  TreeBuilder() { add_node(-1, "", 0, 0); }

  // Adds a child of `parent` (0 = root) named `local`; returns its builder id.
  // `out_bytes` is the size of its output, added to activation_bytes per call.
  int add(int parent, const std::string& local, int64_t params = 0, int64_t out_bytes = 0) {
    return add_node(parent, local, params, out_bytes);
  }

  // Records one call of node `id` at the next position of the execution order.
  TreeBuilder& call(int id) {
    ModuleNode& n = nodes_[id];
    if (n.first_call < 0) n.first_call = next_call_++;
    ++n.calls;
    n.activation_bytes += out_bytes_[id];
    return *this;
  }

  // Calls `id` then, recursively, its children in the order added (a plain forward).
  TreeBuilder& run(int id) {
    call(id);
    for (int c : children_[id]) run(c);
    return *this;
  }

  ModuleNode& node(int id) { return nodes_[id]; }

  std::vector<ModuleNode> build() const {
    std::vector<ModuleNode> out;
    std::vector<int> new_index(nodes_.size(), -1);
    std::function<void(int)> visit = [&](int id) {
      new_index[id] = static_cast<int>(out.size());
      out.push_back(nodes_[id]);
      out.back().parent = id == 0 ? -1 : new_index[parents_[id]];
      for (int c : children_[id]) visit(c);
    };
    visit(0);
    return out;
  }

 private:
  int add_node(int parent, const std::string& local, int64_t params, int64_t out_bytes) {
    const int id = static_cast<int>(nodes_.size());
    ModuleNode n;
    n.name = parent <= 0 ? local : nodes_[parent].name + "." + local;
    n.param_bytes = params;
    nodes_.push_back(n);
    parents_.push_back(parent);
    children_.emplace_back();
    out_bytes_.push_back(out_bytes);
    if (parent >= 0) children_[parent].push_back(id);
    return id;
  }

  std::vector<ModuleNode> nodes_;
  std::vector<int> parents_;
  std::vector<std::vector<int>> children_;
  std::vector<int64_t> out_bytes_;
  int next_call_ = 0;
};

inline int index_of(const std::vector<ModuleNode>& nodes, const std::string& name) {
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].name == name) return static_cast<int>(i);
  }
  throw std::out_of_range("no module named '" + name + "'");
}

// Partition of the module called `name`.
inline int part(const Plan& plan, const std::vector<ModuleNode>& nodes, const std::string& name) {
  return plan.assignment[index_of(nodes, name)];
}

inline double max_stage_cost(const Plan& plan) {
  return *std::max_element(plan.stage_cost.begin(), plan.stage_cost.end());
}

// A Sequential of leaves with the given parameter sizes, run once.
inline std::vector<ModuleNode> sequential(const std::vector<int64_t>& params) {
  TreeBuilder b;
  for (size_t i = 0; i < params.size(); ++i) b.add(0, std::to_string(i), params[i]);
  b.run(0);
  return b.build();
}

// embed, layers.{0..blocks-1}.{attn,mlp,ln}, head; every block equal.
inline std::vector<ModuleNode> transformer(int blocks, int64_t embed, int64_t head,
                                           int64_t attn = 4 * kMiB, int64_t mlp = 8 * kMiB,
                                           int64_t ln = kMiB / 64) {
  TreeBuilder b;
  b.add(0, "embed", embed);
  const int layers = b.add(0, "layers");
  for (int k = 0; k < blocks; ++k) {
    const int blk = b.add(layers, std::to_string(k));
    b.add(blk, "attn", attn);
    b.add(blk, "mlp", mlp);
    b.add(blk, "ln", ln);
  }
  b.add(0, "head", head);
  b.run(0);
  return b.build();
}

}  // namespace smp::partition::testing
