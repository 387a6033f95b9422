#include "smp_core/detail/autograd_graph.h"

#include <torch/csrc/autograd/variable.h>

#include <unordered_set>

namespace smp::detail {

void mark_reachable(const std::vector<at::Tensor>& outputs,
                    const std::unordered_map<const torch::autograd::Node*, int64_t>& index,
                    std::vector<char>& reachable) {
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  auto visit = [&](torch::autograd::Node* n) {
    if (n != nullptr && seen.insert(n).second) stack.push_back(n);
  };
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    if (out.grad_fn()) {
      visit(out.grad_fn().get());
    } else {  // a leaf: its own accumulator
      visit(torch::autograd::impl::try_get_grad_accumulator(out).get());
    }
  }
  while (!stack.empty()) {
    torch::autograd::Node* n = stack.back();
    stack.pop_back();
    auto it = index.find(n);
    if (it != index.end()) reachable[it->second] = 1;
    for (const auto& edge : n->next_edges()) visit(edge.function.get());
  }
}

}  // namespace smp::detail
