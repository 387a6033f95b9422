#include "hooks/default_hooks.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>
#include <mutex>

#include "hooks/builtin.h"
#include "hooks/detail/collectives.h"
#include "smp_core/errors.h"

namespace smp::hooks {
namespace {

const ProcessGroupPtr& group_of(const ProcessGroupPtr& state, const GradBucket& bucket) {
  return state ? state : bucket.process_group();
}

using T = BuiltinCommHookType;

// The names of the dtype's compress hook and wrapper, from the one table (builtin.cpp).
const std::string& compress_name(at::ScalarType dtype) {
  return builtin_hook_name(dtype == at::kHalf ? T::kFp16Compress : T::kBf16Compress);
}
const std::string& wrapper_name(at::ScalarType dtype) {
  return builtin_hook_name(dtype == at::kHalf ? T::kFp16CompressWrapper : T::kBf16CompressWrapper);
}

class AllreduceHook : public CommHook {
 public:
  explicit AllreduceHook(ProcessGroupPtr state) : state_(std::move(state)) {}
  FuturePtr run(GradBucket& bucket) override {
    const auto& pg = group_of(state_, bucket);
    // Divide first, as torch does: the sum of means cannot overflow where the sum could.
    at::Tensor buf = bucket.buffer();
    buf.div_(pg->getSize());
    return detail::allreduce_sum(pg, buf);
  }
  std::string name() const override { return builtin_hook_name(T::kAllreduce); }
  bool issues_all_in_run() const override { return true; }

 private:
  ProcessGroupPtr state_;
};

class CompressHook : public CommHook {
 public:
  CompressHook(at::ScalarType dtype, ProcessGroupPtr state)
      : dtype_(dtype), state_(std::move(state)) {}
  FuturePtr run(GradBucket& bucket) override {
    const auto& pg = group_of(state_, bucket);
    // Apply the division first to avoid overflow, especially for FP16.
    at::Tensor compressed = bucket.buffer().to(dtype_).div_(pg->getSize());
    return detail::allreduce_sum(pg, compressed);
  }
  at::Tensor result(GradBucket& bucket, const c10::IValue& value) override {
    at::Tensor buf = bucket.buffer();
    buf.copy_(tensor_of(value, "the future of comm hook " + name()));
    return buf;
  }
  std::string name() const override { return compress_name(dtype_); }
  bool issues_all_in_run() const override { return true; }

 private:
  at::ScalarType dtype_;
  ProcessGroupPtr state_;
};

class CompressWrapper : public CommHook {
 public:
  CompressWrapper(at::ScalarType dtype, CommHookPtr inner)
      : dtype_(dtype), inner_(std::move(inner)) {
    if (!inner_)
      throw ConfigError("smp: " + wrapper_name(dtype) + ": the inner hook is null");
  }
  FuturePtr run(GradBucket& bucket) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      originals_[&bucket] = bucket.buffer();
    }
    bucket.set_buffer(bucket.buffer().to(dtype_));
    return inner_->run(bucket);
  }
  at::Tensor result(GradBucket& bucket, const c10::IValue& value) override {
    at::Tensor reduced = inner_->result(bucket, value);
    at::Tensor original;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = originals_.find(&bucket);
      SMP_CHECK(it != originals_.end(), name(), ": result() without run() for bucket ",
                bucket.index());
      original = std::move(it->second);
      originals_.erase(it);
    }
    original.copy_(reduced);  // decompress into the original buffer
    bucket.set_buffer(original);
    return original;
  }
  std::string name() const override {
    return wrapper_name(dtype_) + "(" + inner_->name() + ")";
  }
  bool issues_all_in_run() const override { return inner_->issues_all_in_run(); }

 private:
  at::ScalarType dtype_;
  CommHookPtr inner_;
  std::mutex mu_;
  std::map<const GradBucket*, at::Tensor> originals_;  // buckets between run and result
};

}  // namespace

CommHookPtr allreduce_hook(ProcessGroupPtr state) {
  return std::make_shared<AllreduceHook>(std::move(state));
}
CommHookPtr fp16_compress_hook(ProcessGroupPtr state) {
  return std::make_shared<CompressHook>(at::kHalf, std::move(state));
}
CommHookPtr bf16_compress_hook(ProcessGroupPtr state) {
  return std::make_shared<CompressHook>(at::kBFloat16, std::move(state));
}
CommHookPtr fp16_compress_wrapper(CommHookPtr inner) {
  return std::make_shared<CompressWrapper>(at::kHalf, std::move(inner));
}
CommHookPtr bf16_compress_wrapper(CommHookPtr inner) {
  return std::make_shared<CompressWrapper>(at::kBFloat16, std::move(inner));
}

}  // namespace smp::hooks
