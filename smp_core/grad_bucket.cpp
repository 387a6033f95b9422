#include "smp_core/grad_bucket.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "smp_core/comm.h"
#include "smp_core/errors.h"

namespace smp {

GradBucket::GradBucket(size_t index, size_t bucket_count, at::Tensor buffer,
                       std::vector<at::Tensor> parameters, std::vector<int64_t> offsets,
                       c10::intrusive_ptr<c10d::ProcessGroup> process_group, bool shadow)
    : index_(index),
      bucket_count_(bucket_count),
      buffer_(std::move(buffer)),
      parameters_(std::move(parameters)),
      offsets_(std::move(offsets)),
      pg_(std::move(process_group)),
      shadow_(shadow) {
  SMP_CHECK(parameters_.size() == offsets_.size(), "GradBucket: ", parameters_.size(),
            " parameters but ", offsets_.size(), " offsets");
}

GradBucket::~GradBucket() = default;

void GradBucket::set_buffer(at::Tensor buffer) {
  SMP_CHECK(buffer.defined() && buffer.numel() == buffer_.numel(),
            "GradBucket.set_buffer: bucket ", index_, " holds ", buffer_.numel(),
            " elements, the new buffer ", buffer.defined() ? buffer.numel() : 0);
  buffer_ = std::move(buffer);
}

std::vector<at::Tensor> GradBucket::gradients() const {
  std::vector<at::Tensor> out;
  out.reserve(parameters_.size());
  for (size_t j = 0; j < parameters_.size(); ++j) {
    const auto& p = parameters_[j];
    out.push_back(buffer_.narrow(0, offsets_[j], p.numel()).view(p.sizes()));
  }
  return out;
}

CommHook::~CommHook() = default;

at::Tensor CommHook::result(GradBucket&, const c10::IValue& value) {
  return tensor_of(value, "the future of comm hook " + name());
}

at::Tensor tensor_of(const c10::IValue& value, const std::string& what) {
  if (value.isTensor()) return value.toTensor();
  if (value.isTensorList()) {
    auto list = value.toTensorList();
    if (list.size() > 0) return list.get(0);
  } else if (value.isList()) {
    auto list = value.toListRef();
    if (!list.empty() && list[0].isTensor()) return list[0].toTensor();
  }
  throw std::runtime_error(str_cat("smp: ", what, " holds ", value.tagKind(),
                                   ", expected a Tensor or a list of tensors"));
}

FuturePtr allreduce_flat(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Tensor& t) {
  if (t.numel() == 0) return completed_future(t);  // the same on every rank: same layout
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  const int64_t k = std::min<int64_t>(kMaxAllreduceChunks,
                                      std::max<size_t>(1, bytes / kMinAllreduceChunkBytes));
  if (k == 1 || t.dim() != 1) {
    std::vector<at::Tensor> v{t};
    return pg->allreduce(v)->getFuture();
  }
  c10::List<FuturePtr> futs(c10::FutureType::create(c10::TensorType::get()));
  for (const auto& chunk : t.chunk(k)) {
    std::vector<at::Tensor> v{chunk};
    futs.push_back(pg->allreduce(v)->getFuture());
  }
  return c10::collectAll(futs)->then(
      [t](c10::ivalue::Future& all) -> c10::IValue {
        if (all.hasError()) std::rethrow_exception(all.exception_ptr());
        for (const auto& f : all.value().toList()) {
          const auto& fut = f.get().toFuture();
          if (fut->hasError()) std::rethrow_exception(fut->exception_ptr());
        }
        return t;
      },
      c10::TensorType::get());
}

FuturePtr completed_future(const at::Tensor& t) {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  fut->markCompleted(t);
  return fut;
}

void wait_future(const FuturePtr& fut, double timeout_s, const std::string& what) {
  if (!fut->completed()) {
    // Only a notification runs in the callback (on a Gloo thread): collectives are
    // issued by the comm thread, never from completion callbacks.
    struct Waiter {
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
    };
    auto w = std::make_shared<Waiter>();
    fut->addCallback([w](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> lock(w->mu);
      w->done = true;
      w->cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(w->mu);
    auto limit = std::chrono::duration<double>(timeout_s);
    if (!w->cv.wait_for(lock, limit, [&] { return w->done; }))
      throw TimeoutError(str_cat("smp: timed out after ", timeout_s, " s waiting for ", what));
  }
  if (fut->hasError()) {
    std::string msg = fut->tryRetrieveErrorMessage();
    throw CommError(
        str_cat("smp: ", what, " failed: ", with_peer_names(msg.substr(0, msg.find('\n')))));
  }
}

}  // namespace smp
