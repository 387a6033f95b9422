// A call of a module owned by another pp rank, as one node of the caller's autograd graph.
//
// Note [Remote call node]
// The caller sends a kRequest and gets the owner's outputs back (Python encodes the
// arguments and decodes the answer's structure: pipeline.py). connect_remote_call()
// then makes those outputs the outputs of one autograd node, RemoteCallBackward, whose
// inputs are the call's input tensors. When autograd reaches that node it sends the
// output gradients to the owner (a kBackwardRequest) and waits for the input gradients
// (the kBackwardResponse), which the owner computes on the graph it kept for the call.
// That runs entirely in C++: the backward of a remote call does not enter Python, so on
// the driver a microbatch that calls one other rank crosses between Python and C++ for
// its step body and its forward call, not for the call's backward too
// (Dispatcher::Stats::crossings; issue 21's target is at most 3).
//
// Which gradients travel is said by a flags string, one byte per tensor, 1 where the
// tensor is sent (gradient_flags()): the backward request's meta, over the call's
// outputs, and the backward answer's, over its inputs. An output that requires grad
// and gets no gradient is sent as zeros, as torch.autograd.Function does.
//
// An error answer (kError) or the step's kAbort is raised through the Dispatcher's
// ErrorRaiser, which rebuilds the owner's exception (Python: remote_errors.py).
//
// Thread-safety: the node runs on whichever thread autograd runs it (the task's own
// thread on CPU; a device thread is no task and waits for the token's holder:
// Dispatcher::call's for_holder).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace smp {

class Dispatcher;

struct RemoteCallId {
  int owner = -1;       // the pp rank that runs the module
  int64_t mb = -1;      // the caller's microbatch
  int64_t call_id = 0;  // unique per (caller, microbatch)
  std::string name;     // the module, for messages
};

// Returns `outputs` (the owner's answer: fresh tensors) as outputs of a RemoteCallBackward
// node whose inputs are `inputs`; output i is differentiable when requires_grad[i].
// Call with grad mode on and some input requiring grad.
std::vector<at::Tensor> connect_remote_call(const std::shared_ptr<Dispatcher>& dispatcher,
                                            RemoteCallId id, const std::vector<at::Tensor>& inputs,
                                            std::vector<at::Tensor> outputs,
                                            const std::vector<bool>& requires_grad);

// One byte per entry, 1 where set: the flags meta of kBackwardRequest and
// kBackwardResponse. parse_gradient_flags throws CommError unless `meta` is `n`
// such bytes.
std::string gradient_flags(const std::vector<bool>& present);
std::vector<bool> parse_gradient_flags(const std::string& meta, size_t n, const std::string& what);

}  // namespace smp
