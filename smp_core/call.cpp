#include "smp_core/call.h"

#include <atomic>
#include <map>
#include <mutex>
#include <stdexcept>

#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

#include "smp_core/call_meta.h"
#include "smp_core/dispatch.h"
#include "smp_core/errors.h"
#include "smp_core/p2p.h"
#include "smp_core/remote_call.h"
#include "smp_core/task.h"

namespace smp {

struct Caller::Impl {
  std::mutex mu;  // guards `dispatcher` and `next`
  std::shared_ptr<Dispatcher> dispatcher;
  const int64_t id_base;
  // Microbatch -> its next call id: at most the step's microbatches, cleared each step.
  std::map<int64_t, int64_t> next;
  // A scalar that requires grad, an input of every call's node, so that a call is a
  // node of the graph even when none of its inputs requires grad (the owner's
  // parameters still need their gradients).
  const at::Tensor anchor = at::zeros({}).requires_grad_();
  std::atomic<int64_t> fast_calls{0};

  Impl(std::shared_ptr<Dispatcher> d, int64_t base) : dispatcher(std::move(d)), id_base(base) {}
};

Caller::Caller(std::shared_ptr<Dispatcher> dispatcher, int64_t id_base)
    : impl_(std::make_unique<Impl>(std::move(dispatcher), id_base)) {}

Caller::~Caller() = default;

CallOutputs Caller::call(const std::string& module, int owner, CallArgs args,
                         std::string mode_flags) {
  auto& I = *impl_;
  const TaskContext* task = current_task();
  const int64_t mb = task ? task->mb.load() : -1;
  if (mb < 0)
    throw std::runtime_error(str_cat("smp: module '", module, "' lives on pp rank ", owner,
                                     "; call the model inside an @smp.step function"));
  std::shared_ptr<Dispatcher> dispatcher;
  int64_t call_id = 0;
  {
    std::lock_guard<std::mutex> lock(I.mu);
    dispatcher = I.dispatcher;
    call_id = I.id_base + I.next[mb]++;
  }
  if (!dispatcher)
    throw std::runtime_error(str_cat("smp: module '", module, "' was called after its pipeline "
                                     "engine shut down"));
  const bool grad = c10::GradMode::is_enabled();
  const bool fast = args.skeleton.empty();

  RequestMeta meta;
  meta.module = module;
  meta.grad = grad;
  meta.mode_flags = std::move(mode_flags);
  meta.requires_grad.reserve(args.tensors.size());
  for (const at::Tensor& t : args.tensors) meta.requires_grad.push_back(t.requires_grad());
  meta.skeleton = std::move(args.skeleton);
  Message request;
  request.mb = mb;
  request.call_id = call_id;
  request.kind = kRequest;
  request.meta = encode_request(meta);
  request.tensors.reserve(args.tensors.size());
  for (const at::Tensor& t : args.tensors) request.tensors.push_back(t.detach());

  const std::string what = str_cat("the output of '", module, "' (microbatch ", mb, ", call ",
                                   call_id, ") from pp rank ", owner);
  // A forward call: the token comes back at the microbatch's forward priority.
  Message answer = dispatcher->call(owner, std::move(request), kResponse, /*backward=*/false, what);
  if (answer.kind == kError || answer.kind == kAbort) dispatcher->raise_answer(answer);
  AnswerMeta out = decode_answer(answer.meta, answer.tensors.size(), what);

  CallOutputs result;
  result.skeleton = std::move(out.skeleton);
  result.tensors = std::move(answer.tensors);
  if (grad) {
    std::vector<at::Tensor> inputs;
    inputs.reserve(args.tensors.size() + 1);
    inputs.push_back(I.anchor);
    inputs.insert(inputs.end(), args.tensors.begin(), args.tensors.end());
    result.tensors = connect_remote_call(dispatcher, RemoteCallId{owner, mb, call_id, module},
                                         inputs, std::move(result.tensors), out.requires_grad);
  }
  if (fast) I.fast_calls.fetch_add(1, std::memory_order_relaxed);
  return result;
}

void Caller::begin_step() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->next.clear();
}

void Caller::close() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->dispatcher.reset();
}

int64_t Caller::fast_calls() const { return impl_->fast_calls.load(); }

}  // namespace smp
