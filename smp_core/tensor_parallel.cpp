#include "smp_core/tensor_parallel.h"

#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "smp_core/compat/torch_compat.h"
#include "smp_core/errors.h"
#include "smp_core/runtime.h"

// Note [Entering and leaving a distributed module]
// A distributed module (smp.nn) computes with weights cut across its tp group, and
// Megatron's pattern needs exactly one collective per block each way: a column-cut
// layer takes the whole input and yields a slice of the output features, a row-cut
// layer takes that slice and yields a summand of the whole output. Around that pair:
//
//   - prescaled_batch: the tp ranks hold the same batch. enter() is the identity and
//     its backward sums the input gradients (each rank has only its features' part);
//     leave() sums the summands (all-reduce) and its backward is the identity.
//   - otherwise (SMP's default) each tp rank holds its own batch. enter() gathers the
//     group's batches along dim 0, in tp rank order, so every rank computes its slice
//     of the features for all of them; its backward sums the gradients and keeps this
//     rank's rows. leave() sums the summands and keeps this rank's rows (a
//     reduce-scatter); its backward gathers every rank's rows of the gradient, which
//     is the gradient of each rank's summand. The bytes moved per block are those of
//     one all-reduce of the group's activations, split into a gather and a scatter,
//     and everything between two distributed blocks (residuals, layer norms, the
//     loss) runs on the rank's own rows only.
//
// Every rank of a tp group runs the same distributed modules on the same microbatches
// in the same order (same plan, same program), so these collectives are issued in the
// same order on every rank of the group: forward ones on the thread that runs the
// module, backward ones on the thread running autograd's graph, which walks identical
// graphs identically. The reduce-scatter is an all-reduce and a narrow under Gloo,
// which has no reduce-scatter in every torch smp supports; NCCL's is used for CUDA.

namespace smp::tp {
namespace {

using torch::autograd::variable_list;

// Sums `t` over the group in place (a contiguous tensor).
void allreduce_(at::Tensor& t, const Group& g, const std::string& what) {
  std::vector<at::Tensor> v{t};
  wait_work(g.pg->allreduce(v), g.timeout_s, what);
}

// The group's tensors of `t`'s shape, concatenated along dim 0 in tp rank order.
at::Tensor gather_rows(const at::Tensor& t, const Group& g, const std::string& what) {
  at::Tensor in = t.contiguous();
  std::vector<at::Tensor> parts;
  parts.reserve(g.size);
  for (int i = 0; i < g.size; ++i) parts.push_back(at::empty_like(in));
  std::vector<std::vector<at::Tensor>> out{parts};
  std::vector<at::Tensor> ins{in};
  wait_work(g.pg->allgather(out, ins), g.timeout_s, what);
  return at::cat(out[0], 0);
}

// The sum of the group's `t`, this rank's rows of it (dim 0 cut in size parts).
at::Tensor reduce_scatter_rows(const at::Tensor& t, const Group& g, const std::string& what) {
  const int64_t rows = t.size(0) / g.size;
  if (t.is_cuda()) {
    at::Tensor in = t.contiguous();
    std::vector<int64_t> shape = in.sizes().vec();
    shape[0] = rows;
    at::Tensor out = at::empty(shape, in.options());
    wait_work(g.pg->_reduce_scatter_base(out, in), g.timeout_s, what);
    return out;
  }
  at::Tensor sum = t.contiguous().clone();
  allreduce_(sum, g, what);
  return sum.narrow(0, int64_t{g.rank} * rows, rows).clone();
}

class EnterBackward : public torch::autograd::Node {
 public:
  EnterBackward(Group g, std::string what) : g_(std::move(g)), what_(std::move(what)) {}
  std::string name() const override { return "smp::tp::EnterBackward"; }

  variable_list apply(variable_list&& grads) override {
    at::Tensor grad = grads[0];
    if (!grad.defined()) return {at::Tensor()};
    if (g_.prescaled_batch) {
      at::Tensor sum = grad.contiguous().clone();
      allreduce_(sum, g_, what_ + " (backward: the input gradient summed over tp)");
      return {sum};
    }
    return {reduce_scatter_rows(grad, g_, what_ + " (backward: the input gradient's rows)")};
  }

 private:
  Group g_;
  std::string what_;
};

class LeaveBackward : public torch::autograd::Node {
 public:
  LeaveBackward(Group g, std::string what) : g_(std::move(g)), what_(std::move(what)) {}
  std::string name() const override { return "smp::tp::LeaveBackward"; }

  variable_list apply(variable_list&& grads) override {
    at::Tensor grad = grads[0];
    if (!grad.defined()) return {at::Tensor()};
    if (g_.prescaled_batch) return {grad};
    return {gather_rows(grad, g_, what_ + " (backward: the output gradient's rows gathered)")};
  }

 private:
  Group g_;
  std::string what_;
};

// `out`, computed from `in` without autograd, connected to `in`'s graph through `node`.
template <typename NodePtr>
at::Tensor connect(const at::Tensor& in, at::Tensor out, NodePtr node) {
  if (!(torch::autograd::GradMode::is_enabled() && in.requires_grad())) return out;
  node->set_next_edges(torch::autograd::collect_next_edges(in));
  // A view of `in` made without grad (the identity's output) takes the history as
  // torch's own custom functions give it to an input they return.
  torch::autograd::set_history(out, node);
  return out;
}

// Checks that every rank of the group brings a tensor of the same shape and dtype.
void check_same_shape(const at::Tensor& x, const Group& g, const std::string& what) {
  std::vector<int64_t> mine{x.dim(), static_cast<int64_t>(x.scalar_type())};
  for (int64_t s : x.sizes()) mine.push_back(s);
  mine.resize(16, -1);
  at::Tensor t = at::tensor(mine, at::kLong);
  if (x.is_cuda()) t = t.to(x.device());
  at::Tensor all = gather_rows(t.view({1, -1}), g, what + " (shapes)").cpu();
  std::string shapes;
  bool same = true;
  for (int r = 0; r < g.size; ++r) {
    at::Tensor row = all[r];
    if (!at::equal(row, all[0])) same = false;
    shapes += str_cat(r ? ", " : "", "tp rank ", r, ": [");
    const int64_t nd = row[0].item<int64_t>();
    for (int64_t d = 0; d < nd && d < 14; ++d)
      shapes += str_cat(d ? ", " : "", row[2 + d].item<int64_t>());
    shapes += "]";
    if (row[1].item<int64_t>() != all[0][1].item<int64_t>()) shapes += " (another dtype)";
  }
  if (!same)
    throw ConfigError(str_cat("smp: ", what, ": the ranks of a tp group bring inputs of "
                              "different shapes (", shapes, "); without prescaled_batch "
                              "each tp rank's batch must have the same shape"));
}

}  // namespace

Cut parse_cut(const std::string& name) {
  if (name == "column") return Cut::kColumn;
  if (name == "row") return Cut::kRow;
  if (name == "embedding_dim") return Cut::kEmbeddingDim;
  throw ConfigError(str_cat("smp: tensor-parallel cut '", name,
                            "' is unknown (allowed: column, row, embedding_dim)"));
}

void check_divisible(const std::string& what, int64_t value, int size) {
  if (size < 1 || value % size != 0)
    throw ConfigError(str_cat("smp: ", what, "=", value,
                              " is not divisible by 'tensor_parallel_degree'=", size,
                              " (allowed: a multiple of ", size, ")"));
}

Slice slice_of(const std::string& what, Cut cut, const std::vector<int64_t>& full_shape,
               int size, int rank) {
  Slice s;
  const int64_t need = cut == Cut::kColumn ? 1 : 2;
  if (static_cast<int64_t>(full_shape.size()) < need)
    throw ConfigError(str_cat("smp: ", what, ": a ", full_shape.size(),
                              "-d tensor cannot be cut along dim ", need - 1));
  if (rank < 0 || rank >= size)
    throw ConfigError(str_cat("smp: ", what, ": tp rank ", rank, " outside [0, ", size, ")"));
  s.dim = cut == Cut::kColumn ? 0 : 1;
  s.full = full_shape[s.dim];
  check_divisible(what, s.full, size);
  s.length = s.full / size;
  s.start = int64_t{rank} * s.length;
  return s;
}

at::Tensor take(const at::Tensor& full, const Slice& s) {
  return full.narrow(s.dim, s.start, s.length);
}

Group current_group() {
  Group g;
  if (!is_initialized()) return g;
  Runtime& rt = runtime();
  const Topology& topo = rt.topology();
  if (topo.tp_size() <= 1 || !rt.groups().tp) return g;
  g.pg = rt.groups().tp;
  g.size = topo.tp_size();
  g.rank = topo.tp_rank(rt.rank());
  g.prescaled_batch = rt.config().prescaled_batch;
  g.timeout_s = rt.config().timeout_s;
  return g;
}

at::Tensor enter(const at::Tensor& x, const Group& g, bool check, const std::string& what) {
  if (!g.pg || g.size <= 1) return x;
  if (g.prescaled_batch) {
    at::Tensor same;
    {
      at::NoGradGuard no_grad;
      same = x.view_as(x);
    }
    return connect(x, std::move(same), compat::make_node<EnterBackward>(g, what));
  }
  if (check) check_same_shape(x, g, what);
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = gather_rows(x, g, what + " (the tp group's batches gathered)");
  }
  return connect(x, std::move(out), compat::make_node<EnterBackward>(g, what));
}

at::Tensor leave(const at::Tensor& y, const Group& g, const std::string& what) {
  if (!g.pg || g.size <= 1) return y;
  if (y.dim() < 1 || (!g.prescaled_batch && y.size(0) % g.size != 0))
    throw ConfigError(str_cat("smp: ", what, ": output of shape ", y.sizes(),
                              " cannot be cut into ", g.size, " tp ranks' rows"));
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    if (g.prescaled_batch) {
      out = y.contiguous().clone();
      allreduce_(out, g, what + " (the summands of the output summed over tp)");
    } else {
      out = reduce_scatter_rows(y, g, what + " (the output summed over tp, own rows kept)");
    }
  }
  return connect(y, std::move(out), compat::make_node<LeaveBackward>(g, what));
}

at::Tensor dropout(const at::Tensor& x, double p, bool training,
                   const std::vector<int64_t>& full_shape, const Slice& s) {
  if (!training || p == 0.0 || x.numel() == 0) return x;
  // The reference drops its whole input: a mask of that shape, dtype and device, drawn
  // the way at::dropout draws it (the same generator calls), then this rank's slice.
  at::Tensor mask;
  {
    at::NoGradGuard no_grad;
    mask = at::dropout(at::ones(full_shape, x.options().requires_grad(false)), p, true);
  }
  if (s.length != 0 && s.length != s.full) mask = take(mask, s);
  return x * mask;
}

}  // namespace smp::tp
