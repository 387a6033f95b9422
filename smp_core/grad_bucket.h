// GradBucket: one bucket of gradients as a communication hook sees it, and CommHook,
// the C++ interface of hooks (built-ins live in hooks/, Python callables are adapted
// in python/csrc/bind_reducer.cpp). Mirrors torch.distributed.GradBucket and
// c10d::CppCommHookInterface; see docs/reducer.md.
//
// Threads: the reducer calls CommHook::run and CommHook::result on its comm thread,
// one bucket at a time, in bucket index order on every rank (see Note [Ordered bucket
// communication] in comm_queue.h). run() may issue several collectives and wait on
// them in turn; it must not issue collectives from a future's completion callback.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

namespace c10 {
struct IValue;
namespace ivalue {
struct Future;
}  // namespace ivalue
}  // namespace c10

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace smp {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// One bucket of one step. The reducer creates it (as a shared_ptr) when it launches
// the bucket; the hook may keep it until its future completes.
class GradBucket : public std::enable_shared_from_this<GradBucket> {
 public:
  // `buffer` is flat and contiguous; parameter j's gradient is
  // buffer[offsets[j], offsets[j] + numel(parameters[j])).
  GradBucket(size_t index, size_t bucket_count, at::Tensor buffer,
             std::vector<at::Tensor> parameters, std::vector<int64_t> offsets,
             c10::intrusive_ptr<c10d::ProcessGroup> process_group, bool shadow = false);
  ~GradBucket();

  // Position of the bucket in launch order; unique within a step.
  size_t index() const { return index_; }
  size_t bucket_count() const { return bucket_count_; }
  // Whether this is the last bucket the reducer launches this step.
  bool is_last() const { return index_ + 1 == bucket_count_; }

  // The flat gradient buffer (the reducer's, unless a hook replaced it).
  const at::Tensor& buffer() const { return buffer_; }
  // Replaces the buffer that buffer() and gradients() see (compression hooks). The
  // reducer's own buffer is not touched: results come back through the future.
  void set_buffer(at::Tensor buffer);
  // Views of buffer(), one per parameter, shaped like it (in parameters() order).
  std::vector<at::Tensor> gradients() const;
  // The parameters whose gradients this bucket holds.
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }

  // The reducer's group: hooks whose state names no group use this one.
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }
  // True in a Join shadow step: the buffer is zeros because this rank has no data.
  bool is_shadow() const { return shadow_; }

 private:
  size_t index_;
  size_t bucket_count_;
  at::Tensor buffer_;
  std::vector<at::Tensor> parameters_;
  std::vector<int64_t> offsets_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  bool shadow_;
};

// A gradient communication hook (torch's `hook(state, bucket) -> Future[Tensor]`).
class CommHook {
 public:
  virtual ~CommHook();
  // Starts reducing `bucket`; returns a future of the reduced bucket. Runs on the
  // reducer's comm thread; the next bucket's run() starts only after the returned
  // future completed.
  virtual FuturePtr run(GradBucket& bucket) = 0;
  // Turns the completed future's value into the reduced flat tensor (numel equal to
  // the bucket's; any floating dtype: the reducer casts while copying back). Runs on
  // the comm thread right after the future completed. Default: the tensor the value
  // holds (a Tensor, or the first of a list of tensors).
  virtual at::Tensor result(GradBucket& bucket, const c10::IValue& value);
  // Name for messages ("allreduce", "fp16_compress", "python hook f", ...).
  virtual std::string name() const = 0;
  // True if run() issues every collective of the bucket before it returns (none from
  // completion callbacks or in result()). The comm thread may then run the next
  // bucket's hook without waiting for this future: the order of collectives is fixed
  // at issue time, and the backend may overlap them. Default false: always waits.
  virtual bool issues_all_in_run() const { return false; }
};

using CommHookPtr = std::shared_ptr<CommHook>;

// The tensor a hook's future value holds: a Tensor, or the first element of a tensor
// list. Throws std::runtime_error naming `what` for anything else.
at::Tensor tensor_of(const c10::IValue& value, const std::string& what);

// Sums the flat tensor `t` in place over `pg`; the future's value is `t`. A large
// tensor goes as up to kMaxAllreduceChunks allreduces of >= kMinAllreduceChunkBytes,
// issued back to back from the calling thread, so the backend's worker threads share
// the work (Gloo: 2 threads by default; ~15% faster for 20 MiB on 2 ranks).
constexpr int kMaxAllreduceChunks = 4;
constexpr size_t kMinAllreduceChunkBytes = size_t{2} << 20;
FuturePtr allreduce_flat(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Tensor& t);

// A future already completed with `t` (noop hooks, tests).
FuturePtr completed_future(const at::Tensor& t);

// Blocks until `fut` completes or `timeout_s` passes. Throws TimeoutError (timeout)
// or CommError (the future holds an error), both naming `what`.
void wait_future(const FuturePtr& fut, double timeout_s, const std::string& what);

}  // namespace smp
