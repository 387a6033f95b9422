#include "smp_core/serve.h"

#include <atomic>
#include <mutex>
#include <memory>
#include <unordered_map>

#include <c10/core/GradMode.h>

#include "smp_core/autocast_state.h"
#include "smp_core/call_meta.h"
#include "smp_core/dispatch.h"
#include "smp_core/errors.h"

namespace smp {

struct Server::Impl {
  ServeHooks hooks;
  const int pp_rank;
  std::mutex mu;  // guards everything below
  std::weak_ptr<Dispatcher> dispatcher;
  // Note [Known forward requests]: the metadata served this step, decoded once.
  std::unordered_map<std::string, std::shared_ptr<const RequestMeta>> known;
  std::atomic<int64_t> served{0};
  // The answer metadata of one tensor, by its requires_grad (the usual answer).
  const std::string one_tensor[2] = {encode_answer(AnswerMeta{{false}, {}}),
                                     encode_answer(AnswerMeta{{true}, {}})};

  Impl(ServeHooks h, int rank) : hooks(std::move(h)), pp_rank(rank) {}

  std::shared_ptr<const RequestMeta> knows(const std::string& meta) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = known.find(meta);
    return it == known.end() ? nullptr : it->second;
  }

  void learn(const std::string& meta, std::shared_ptr<const RequestMeta> decoded,
             bool modes_changed) {
    std::lock_guard<std::mutex> lock(mu);
    if (modes_changed) known.clear();
    if (known.size() < kMaxKnown) known.emplace(meta, std::move(decoded));
  }

  Message run(const Message& request) {
    if (request.kind != kRequest)  // its forward kept nothing: it recorded no graph here
      throw CommError(str_cat("smp: pp rank ", pp_rank, " got the backward of call ",
                              request.call_id, " (microbatch ", request.mb, ") from pp rank ", request.src,
                              ", whose forward recorded no autograd graph here"));
    std::shared_ptr<const RequestMeta> decoded = knows(request.meta);
    const bool known_now = decoded && decoded->requires_grad.size() == request.tensors.size();
    if (!known_now)
      decoded = std::make_shared<const RequestMeta>(decode_request(
          request.meta, request.tensors.size(),
          str_cat("the request of call ", request.call_id, " (microbatch ", request.mb,
                  ") from pp rank ", request.src)));
    const RequestMeta& meta = *decoded;
    const bool grad = meta.grad;
    std::vector<at::Tensor> leaves = request.tensors;
    std::vector<at::Tensor> args;
    args.reserve(leaves.size());
    // Note [Received inputs are not weights] (autocast_state.h).
    const bool views = grad && autocast_state::capture() != 0;
    for (size_t i = 0; i < leaves.size(); ++i) {
      if (grad && meta.requires_grad[i]) leaves[i].requires_grad_(true);
      at::Tensor given = leaves[i];
      if (views && given.requires_grad() && given.scalar_type() == at::kFloat) {
        c10::AutoGradMode on(true);
        given = given.view_as(given);
      }
      args.push_back(std::move(given));
    }
    ModuleCall call{meta.module, request.mb, known_now ? nullptr : &meta.mode_flags,
                    std::move(args), meta.skeleton};
    ModuleResult result;
    {
      c10::AutoGradMode mode(grad);
      result = hooks.run(call);
    }
    if (known_now)
      served.fetch_add(1, std::memory_order_relaxed);
    else
      learn(request.meta, std::move(decoded), result.modes_changed);

    Message answer;
    answer.mb = request.mb;
    answer.call_id = request.call_id;
    answer.kind = kResponse;
    if (result.skeleton.empty() && result.outputs.size() == 1) {
      answer.meta = one_tensor[result.outputs[0].requires_grad() ? 1 : 0];
    } else {
      AnswerMeta out;
      out.skeleton = std::move(result.skeleton);
      out.requires_grad.reserve(result.outputs.size());
      for (const at::Tensor& t : result.outputs) out.requires_grad.push_back(t.requires_grad());
      answer.meta = encode_answer(out);
    }
    answer.tensors.reserve(result.outputs.size());
    for (const at::Tensor& t : result.outputs) answer.tensors.push_back(t.detach());
    if (grad) {  // Note [Served backward]: the call's backward is served from these
      std::shared_ptr<Dispatcher> d;
      {
        std::lock_guard<std::mutex> lock(mu);
        d = dispatcher.lock();
      }
      if (d)
        d->keep_for_backward(request.src, request.mb, request.call_id, std::move(leaves),
                             std::move(result.outputs));
    }
    return answer;
  }
};

Server::Server(ServeHooks hooks, int pp_rank)
    : impl_(std::make_unique<Impl>(std::move(hooks), pp_rank)) {
  SMP_CHECK(impl_->hooks.run, "Server: no run hook");
}

Server::~Server() = default;

void Server::attach(std::weak_ptr<Dispatcher> dispatcher) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->dispatcher = std::move(dispatcher);
}

Message Server::serve(const Message& request) {
  std::exception_ptr error;
  try {
    return impl_->run(request);
  } catch (...) {
    error = std::current_exception();
  }
  Message answer;
  answer.mb = request.mb;
  answer.call_id = request.call_id;
  answer.kind = kError;
  if (impl_->hooks.encode_failure) {
    answer.meta = impl_->hooks.encode_failure(error, request.mb, request.kind == kBackwardRequest);
  } else {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      answer.meta = e.what();
    } catch (...) {
      answer.meta = "smp: an unknown error";
    }
  }
  return answer;
}

void Server::begin_step() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->known.clear();
}

int64_t Server::served() const { return impl_->served.load(); }

size_t Server::known() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->known.size();
}

}  // namespace smp
