// A backward split into its input-gradient half (I) and its weight-gradient half (W),
// for zero_bubble (smp_core/plan.h): the previous hop waits only for I; W fills a
// bubble later. Included only from smp_core .cpp files and tests.
//
// Note [Split backward]
// A served call's graph runs from its outputs to its inputs (the leaves the request's
// tensors became) and to the parameters it used. Let A be the nodes from which an
// input is reachable: the input-gradient path. I runs through A only (torch's engine
// with the inputs' edges as outputs and accumulate_grad off, so no parameter's
// AccumulateGrad runs and each node computes only the outputs on A), and captures what
// enters the boundary nodes: those of A with an edge to a node outside A that leads to
// a parameter (Linear's AddmmBackward, whose mat2 edge leads to the weight). W starts
// from the boundary nodes with the captured gradients (and from any output whose graph
// never reaches an input), with the parameters' edges as outputs and accumulate_grad
// on: a boundary node runs again computing only its weight-side outputs, so no kernel
// of I runs twice. This is the cut torch.distributed.pipelining's _backward.py makes
// (stage_backward_input / stage_backward_weight), written over the C++ engine.
//  - Parameters are grouped by the boundary nodes that lead to them (one parameter
//    reached from two boundaries joins them), and each group is one engine call, so
//    a call for one group never runs another group's weight path.
//  - Within a group, a boundary node may lie below another on A (a weight used twice
//    with the input path between the uses). The upper one's rerun then sends an
//    input-path gradient into the lower one again; a pre hook on every boundary node
//    of such a group replaces what arrives with what I captured, as torch's does, so
//    nothing is counted twice (at the cost of recomputing that stretch of A).
//  - Every engine call keeps the graph (W's groups may pass through shared nodes); it
//    goes when the WeightHalf does.
// Results equal the full backward's bit for bit where each parameter gets one
// contribution per call (the usual case); a parameter used twice sums the same terms,
// possibly in another order.
#pragma once

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

namespace smp::detail {

// Each tensor's gradient edge (its grad_fn, or a leaf's accumulator); an empty edge
// for one undefined or not requiring grad. Keeping the edges instead of the tensors
// keeps the graph but not the tensors' memory (Note [Served backward]).
std::vector<torch::autograd::Edge> gradient_edges(const std::vector<at::Tensor>& tensors);

class WeightHalf {
 public:
  WeightHalf();
  ~WeightHalf();
  WeightHalf(WeightHalf&&) noexcept;
  WeightHalf& operator=(WeightHalf&&) noexcept;

  // No parameter gradient to compute.
  bool empty() const;
  // Accumulates the parameters' gradients, running their AccumulateGrad nodes and the
  // hooks on them as a full backward would. At most once; frees the graph.
  void run();

 private:
  friend std::vector<at::Tensor> backward_input_half(const std::vector<torch::autograd::Edge>&,
                                                     const std::vector<at::Tensor>&,
                                                     const std::vector<at::Tensor>&,
                                                     WeightHalf*);
  struct State;
  std::unique_ptr<State> state_;
};

// Runs I for `outputs` (gradient edges; empty ones are skipped) receiving `grads` (one
// each, defined): returns one gradient per
// entry of `inputs` (undefined where it gets none or does not require grad); no
// parameter's .grad changes. `weight` receives W, to run later.
std::vector<at::Tensor> backward_input_half(const std::vector<torch::autograd::Edge>& outputs,
                                            const std::vector<at::Tensor>& grads,
                                            const std::vector<at::Tensor>& inputs,
                                            WeightHalf* weight);
// The same from the output tensors.
std::vector<at::Tensor> backward_input_half(const std::vector<at::Tensor>& outputs,
                                            const std::vector<at::Tensor>& grads,
                                            const std::vector<at::Tensor>& inputs,
                                            WeightHalf* weight);

}  // namespace smp::detail
