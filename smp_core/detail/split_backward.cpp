#include "smp_core/detail/split_backward.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include "smp_core/errors.h"

namespace smp::detail {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using NodePtr = decltype(Edge::function);  // shared_ptr (1.13) or intrusive_ptr (2.x)
using torch::autograd::variable_list;

// Note [Split backward]: replaces what arrives at a boundary node with what I captured.
class ClampHook : public torch::autograd::FunctionPreHook {
 public:
  explicit ClampHook(variable_list grads) : grads_(std::move(grads)) {}
  variable_list operator()(const variable_list& /*arrived*/) override { return grads_; }

 private:
  variable_list grads_;
};

bool is_accumulator(const Node* n) {
  return dynamic_cast<const torch::autograd::AccumulateGrad*>(n) != nullptr;
}

// The graph below some roots: every node, its children, and per node whether an input
// (of `inputs`) or a parameter (any other accumulator) is reachable from it.
struct Graph {
  struct Info {
    NodePtr ptr;  // owning, as an edge to the node holds it
    bool to_input = false, to_param = false;
  };
  std::unordered_map<Node*, Info> info;
  std::vector<Node*> order;  // every node, children before parents

  Graph(const std::vector<Edge>& roots, const std::unordered_set<Node*>& inputs) {
    // Iterative post-order: a node is finished after all its children.
    std::unordered_map<Node*, NodePtr> seen;
    std::vector<std::pair<Node*, size_t>> stack;
    for (const Edge& root : roots) {
      Node* r = root.function.get();
      if (r == nullptr || !seen.emplace(r, root.function).second) continue;
      stack.emplace_back(r, 0);
      while (!stack.empty()) {
        auto& [n, i] = stack.back();
        if (i < n->num_outputs()) {
          const Edge& e = n->next_edge(i++);
          Node* c = e.function.get();
          if (c != nullptr && seen.emplace(c, e.function).second) stack.emplace_back(c, 0);
          continue;
        }
        Info mine;
        mine.ptr = seen.at(n);
        if (inputs.count(n)) mine.to_input = true;
        else if (is_accumulator(n)) mine.to_param = true;
        for (const Edge& e : n->next_edges()) {
          if (!e.function) continue;
          const Info& c = info.at(e.function.get());
          mine.to_input |= c.to_input;
          mine.to_param |= c.to_param;
        }
        info[n] = mine;
        order.push_back(n);
        stack.pop_back();
      }
    }
  }

  bool on_input_path(Node* n) const { return info.at(n).to_input; }

  // The parameters' accumulators reachable from `from` through nodes off the input path.
  std::vector<Node*> params_below(Node* from, bool skip_self) const {
    std::vector<Node*> found, stack;
    std::unordered_set<Node*> seen;
    auto visit = [&](Node* c) {
      if (c == nullptr || on_input_path(c) || !info.at(c).to_param) return;
      if (seen.insert(c).second) stack.push_back(c);
    };
    if (skip_self) {
      for (const Edge& e : from->next_edges()) visit(e.function.get());
    } else {
      visit(from);
    }
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      if (is_accumulator(n)) found.push_back(n);
      for (const Edge& e : n->next_edges()) visit(e.function.get());
    }
    return found;
  }
};

}  // namespace

struct WeightHalf::State {
  struct Group {
    std::vector<Edge> roots;
    variable_list grads;
    std::vector<Edge> params;
    // Boundary nodes to clamp while the group runs (Note [Split backward]), with the
    // gradients I captured at their inputs.
    std::vector<std::pair<NodePtr, variable_list>> clamps;
  };
  std::vector<Group> groups;
  std::vector<Edge> roots;  // hold the graph until W is over
  bool ran = false;
};

WeightHalf::WeightHalf() = default;
WeightHalf::~WeightHalf() = default;
WeightHalf::WeightHalf(WeightHalf&&) noexcept = default;
WeightHalf& WeightHalf::operator=(WeightHalf&&) noexcept = default;

bool WeightHalf::empty() const { return !state_ || state_->groups.empty(); }

void WeightHalf::run() {
  if (!state_) return;
  SMP_CHECK(!state_->ran, "WeightHalf::run: the weight half of this backward already ran");
  state_->ran = true;
  auto& engine = torch::autograd::Engine::get_default_engine();
  for (auto& g : state_->groups) {
    std::vector<torch::autograd::FunctionPreHook*> added;
    for (auto& [node, grads] : g.clamps) {
      auto hook = std::make_unique<ClampHook>(grads);
      added.push_back(hook.get());
      node->add_pre_hook(std::move(hook));
    }
    struct Unclamp {
      State::Group& g;
      std::vector<torch::autograd::FunctionPreHook*>& added;
      ~Unclamp() {
        for (size_t i = 0; i < added.size(); ++i) {
          auto& hooks = g.clamps[i].first->pre_hooks();
          hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                                     [&](const auto& h) { return h.get() == added[i]; }),
                      hooks.end());
        }
      }
    } unclamp{g, added};
    engine.execute(g.roots, g.grads, /*keep_graph=*/true, /*create_graph=*/false,
                   /*accumulate_grad=*/true, g.params);
  }
  state_.reset();  // the graph goes now
}

std::vector<Edge> gradient_edges(const std::vector<at::Tensor>& tensors) {
  std::vector<Edge> edges;
  for (const auto& t : tensors)
    edges.push_back(t.defined() && t.requires_grad() ? torch::autograd::impl::gradient_edge(t)
                                                      : Edge());
  return edges;
}

std::vector<at::Tensor> backward_input_half(const std::vector<at::Tensor>& outputs,
                                            const std::vector<at::Tensor>& grads,
                                            const std::vector<at::Tensor>& inputs,
                                            WeightHalf* weight) {
  return backward_input_half(gradient_edges(outputs), grads, inputs, weight);
}

std::vector<at::Tensor> backward_input_half(const std::vector<Edge>& outputs,
                                            const std::vector<at::Tensor>& grads,
                                            const std::vector<at::Tensor>& inputs,
                                            WeightHalf* weight) {
  SMP_CHECK(outputs.size() == grads.size(), "backward_input_half: ", outputs.size(),
            " outputs and ", grads.size(), " gradients");
  auto state = std::make_unique<WeightHalf::State>();
  std::vector<Edge> roots;
  variable_list root_grads;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].function) continue;
    roots.push_back(outputs[i]);
    root_grads.push_back(grads[i]);
  }
  state->roots = roots;
  std::vector<Edge> captures;  // the inputs', then each boundary node's inputs
  std::vector<int64_t> input_slot(inputs.size(), -1);
  std::unordered_set<Node*> input_nodes;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !inputs[i].requires_grad()) continue;
    Edge e = torch::autograd::impl::gradient_edge(inputs[i]);
    if (!e.function) continue;
    input_slot[i] = static_cast<int64_t>(captures.size());
    input_nodes.insert(e.function.get());
    captures.push_back(std::move(e));
  }
  const Graph graph(roots, input_nodes);

  // The sources of W: boundary nodes (captured by I) and roots off the input path.
  struct Source {
    NodePtr node;
    bool boundary = false;
    size_t first_capture = 0;  // boundary: its inputs' slots in `captures`
    std::vector<size_t> roots;  // off-path root: indices into `roots`
    std::vector<Node*> params;
  };
  std::vector<Source> sources;
  std::unordered_map<Node*, size_t> source_of;
  // Parents before children: the order a whole backward reaches them, so W accumulates
  // the last layers' parameters first, as DDP's buckets expect (they launch in order).
  for (auto it = graph.order.rbegin(); it != graph.order.rend(); ++it) {
    Node* n = *it;
    if (!graph.on_input_path(n) || input_nodes.count(n)) continue;
    if (n->num_inputs() == 0) continue;
    auto params = graph.params_below(n, /*skip_self=*/true);
    if (params.empty()) continue;
    Source s;
    s.boundary = true;
    s.node = graph.info.at(n).ptr;
    s.first_capture = captures.size();
    s.params = std::move(params);
    for (size_t i = 0; i < n->num_inputs(); ++i)
      captures.emplace_back(s.node, static_cast<uint32_t>(i));
    source_of[n] = sources.size();
    sources.push_back(std::move(s));
  }
  for (size_t i = 0; i < roots.size(); ++i) {
    Node* n = roots[i].function.get();
    if (n == nullptr || graph.on_input_path(n) || !graph.info.at(n).to_param) continue;
    auto it = source_of.find(n);
    if (it == source_of.end()) {
      Source s;
      s.node = roots[i].function;
      s.params = graph.params_below(n, /*skip_self=*/false);
      source_of[n] = sources.size();
      sources.push_back(std::move(s));
      it = source_of.find(n);
    }
    sources[it->second].roots.push_back(i);
  }

  // I: the input path only; captures the inputs' gradients and the boundaries' inputs.
  const bool has_weight = !sources.empty();
  variable_list captured;
  if (!roots.empty() && !captures.empty()) {
    captured = torch::autograd::Engine::get_default_engine().execute(
        roots, root_grads, /*keep_graph=*/has_weight, /*create_graph=*/false,
        /*accumulate_grad=*/false, captures);
  }
  std::vector<at::Tensor> result(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    if (input_slot[i] >= 0 && static_cast<size_t>(input_slot[i]) < captured.size())
      result[i] = captured[input_slot[i]];

  // Group the sources that share a parameter (union-find), one engine call per group.
  std::vector<size_t> parent(sources.size());
  std::iota(parent.begin(), parent.end(), 0);
  auto find = [&](size_t x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  };
  std::unordered_map<Node*, size_t> owner;  // parameter -> a source reaching it
  for (size_t s = 0; s < sources.size(); ++s)
    for (Node* p : sources[s].params) {
      auto [it, fresh] = owner.emplace(p, s);
      if (!fresh) parent[find(s)] = find(it->second);
    }
  // Groups in the order of their first source.
  std::vector<WeightHalf::State::Group> groups;
  std::vector<std::unordered_set<Node*>> group_params;
  std::vector<size_t> boundaries;
  std::unordered_map<size_t, size_t> group_of;  // representative -> index in `groups`
  for (size_t s = 0; s < sources.size(); ++s) {
    const auto [slot, fresh] = group_of.emplace(find(s), groups.size());
    if (fresh) {
      groups.emplace_back();
      group_params.emplace_back();
      boundaries.push_back(0);
    }
    const size_t rep = slot->second;
    auto& g = groups[rep];
    const Source& src = sources[s];
    if (src.boundary) {
      ++boundaries[rep];
      const size_t n = src.node->num_inputs();
      variable_list at_inputs(captured.begin() + src.first_capture,
                              captured.begin() + src.first_capture + n);
      for (size_t i = 0; i < n; ++i) {
        if (!at_inputs[i].defined()) continue;
        g.roots.emplace_back(src.node, static_cast<uint32_t>(i));
        g.grads.push_back(at_inputs[i]);
      }
      g.clamps.emplace_back(src.node, std::move(at_inputs));
    }
    for (size_t r : src.roots) {
      g.roots.push_back(roots[r]);
      g.grads.push_back(root_grads[r]);
    }
    for (Node* p : src.params)
      if (group_params[rep].insert(p).second) g.params.emplace_back(graph.info.at(p).ptr, 0);
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    if (boundaries[i] < 2) groups[i].clamps.clear();  // no boundary lies below another
    if (!groups[i].roots.empty()) state->groups.push_back(std::move(groups[i]));
  }
  if (weight) weight->state_ = std::move(state);
  return result;
}

}  // namespace smp::detail
