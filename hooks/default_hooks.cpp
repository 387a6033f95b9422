#include "hooks/default_hooks.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>
#include <mutex>

#include "hooks/detail/collectives.h"
#include "smp_core/errors.h"

namespace smp::hooks {
namespace {

const ProcessGroupPtr& group_of(const ProcessGroupPtr& state, const GradBucket& bucket) {
  return state ? state : bucket.process_group();
}

std::string dtype_tag(at::ScalarType dtype) { return dtype == at::kHalf ? "fp16" : "bf16"; }

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
  std::string name() const override { return "allreduce"; }
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
  std::string name() const override { return dtype_tag(dtype_) + "_compress"; }
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
      throw ConfigError("smp: " + dtype_tag(dtype) + "_compress_wrapper: the inner hook is null");
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
    return dtype_tag(dtype_) + "_compress_wrapper(" + inner_->name() + ")";
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
