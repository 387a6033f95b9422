#include "smp_core/remote_call.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "smp_core/compat/torch_compat.h"
#include "smp_core/dispatch.h"
#include "smp_core/errors.h"
#include "smp_core/p2p.h"
#include "smp_core/task.h"

namespace smp {
namespace {

using torch::autograd::variable_list;

// Note [Remote call node]. Input k of the node is the gradient of the call's k-th
// differentiable output (outputs_[k] is that output's index among all outputs).
class RemoteCallBackward : public torch::autograd::Node {
 public:
  RemoteCallBackward(std::weak_ptr<Dispatcher> dispatcher, RemoteCallId id, size_t num_outputs,
                     std::vector<size_t> outputs, std::vector<at::Tensor> zeros_like,
                     size_t num_inputs)
      : dispatcher_(std::move(dispatcher)), id_(std::move(id)), num_outputs_(num_outputs),
        outputs_(std::move(outputs)), shapes_(std::move(zeros_like)), num_inputs_(num_inputs) {}

  std::string name() const override { return "smp::RemoteCallBackward"; }

  variable_list apply(variable_list&& grads) override {
    auto dispatcher = dispatcher_.lock();
    const std::string what = str_cat("the input gradients of '", id_.name, "' (microbatch ",
                                     id_.mb, ", call ", id_.call_id, ") from pp rank ", id_.owner);
    if (!dispatcher)
      throw CommError(str_cat("smp: the pipeline was shut down before the backward of '",
                              id_.name, "' (microbatch ", id_.mb, ") ran"));
    SMP_CHECK(grads.size() == outputs_.size(), "RemoteCallBackward: ", grads.size(),
              " gradients for ", outputs_.size(), " outputs");
    std::vector<bool> present(num_outputs_, false);
    Message request;
    request.mb = id_.mb;
    request.call_id = id_.call_id;
    request.kind = kBackwardRequest;
    for (size_t k = 0; k < grads.size(); ++k) {
      present[outputs_[k]] = true;
      // Materialized as torch.autograd.Function does: the owner runs the same backward
      // whether or not the caller used the output.
      const at::Tensor& meta = shapes_[k];
      request.tensors.push_back(grads[k].defined()
                                    ? grads[k].contiguous()
                                    : at::zeros(meta.sizes(), meta.options()));
    }
    request.meta = gradient_flags(present);
    // A thread that is no task (autograd's device thread) works for the token's holder.
    const bool for_holder = current_task() == nullptr;
    Message answer = dispatcher->request_native(id_.owner, std::move(request),
                                                kBackwardResponse, /*backward=*/true, what,
                                                for_holder);
    if (answer.kind == kError || answer.kind == kAbort) dispatcher->raise_answer(answer);
    const std::vector<bool> got = parse_gradient_flags(answer.meta, num_inputs_ - 1, what);
    size_t sent = 0;
    for (bool g : got) sent += g;
    if (sent != answer.tensors.size())
      throw CommError(str_cat("smp: pipeline protocol error: ", what, " says ", sent,
                              " gradients and carries ", answer.tensors.size()));
    variable_list out(num_inputs_);  // out[0]: the anchor's, none
    size_t next = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i]) out[i + 1] = std::move(answer.tensors[next++]);
    return out;
  }

 private:
  std::weak_ptr<Dispatcher> dispatcher_;
  RemoteCallId id_;
  size_t num_outputs_;
  std::vector<size_t> outputs_;
  std::vector<at::Tensor> shapes_;  // per differentiable output: a 0-strided stand-in
  size_t num_inputs_;
};

}  // namespace

std::string gradient_flags(const std::vector<bool>& present) {
  std::string meta(present.size(), '\0');
  for (size_t i = 0; i < present.size(); ++i) meta[i] = present[i] ? 1 : 0;
  return meta;
}

std::vector<bool> parse_gradient_flags(const std::string& meta, size_t n, const std::string& what) {
  if (meta.size() != n)
    throw CommError(str_cat("smp: pipeline protocol error: ", what, " flags ", meta.size(),
                            " tensors, expected ", n));
  std::vector<bool> flags(n);
  for (size_t i = 0; i < n; ++i) {
    if (meta[i] != 0 && meta[i] != 1)
      throw CommError(str_cat("smp: pipeline protocol error: ", what, " has a flag byte ",
                              static_cast<int>(static_cast<unsigned char>(meta[i])),
                              " (allowed: 0, 1)"));
    flags[i] = meta[i] == 1;
  }
  return flags;
}

std::vector<at::Tensor> connect_remote_call(const std::shared_ptr<Dispatcher>& dispatcher,
                                            RemoteCallId id, const std::vector<at::Tensor>& inputs,
                                            std::vector<at::Tensor> outputs,
                                            const std::vector<bool>& requires_grad) {
  SMP_CHECK(requires_grad.size() == outputs.size(), "connect_remote_call: ",
            requires_grad.size(), " flags for ", outputs.size(), " outputs");
  SMP_CHECK(!inputs.empty(), "connect_remote_call: no inputs (the anchor comes first)");
  std::vector<size_t> differentiable;
  std::vector<at::Tensor> stand_ins;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!requires_grad[i]) continue;
    differentiable.push_back(i);
    // The shape and options of a zero gradient, held without the output's memory.
    stand_ins.push_back(at::empty({}, outputs[i].options()).expand(outputs[i].sizes()));
  }
  auto node = compat::make_node<RemoteCallBackward>(
      dispatcher, std::move(id), outputs.size(), std::move(differentiable), std::move(stand_ins),
      inputs.size());
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!requires_grad[i]) continue;
    // The owner's answer arrives as fresh tensors; one that is an autograd view of a
    // buffer would take its history from the buffer, so it gets storage of its own.
    if (outputs[i].is_view()) outputs[i] = outputs[i].clone();
    torch::autograd::set_history(outputs[i], node);
  }
  return outputs;
}

}  // namespace smp
