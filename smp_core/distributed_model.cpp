#include "smp_core/distributed_model.h"

#include <torch/torch.h>

#include "smp_core/errors.h"
#include "smp_core/runtime.h"

namespace smp {

struct DistributedModel::Impl {
  std::shared_ptr<torch::nn::Module> module;
  ForwardFn forward;
  DistributedModelOptions opts;
  ProcessGroupPtr pg;
  std::vector<at::Tensor> params;
  std::unique_ptr<Reducer> reducer;
  bool synced = false;  // parameters and buffers broadcast from dp rank 0

  std::vector<at::Tensor> buffers() const {
    std::vector<at::Tensor> out;
    for (auto& b : module->buffers()) out.push_back(b);
    return out;
  }
};

DistributedModel::DistributedModel(std::shared_ptr<torch::nn::SequentialImpl> module,
                                   DistributedModelOptions options, ProcessGroupPtr dp)
    : DistributedModel(module, [m = module.get()](const at::Tensor& x) { return m->forward(x); },
                       std::move(options), std::move(dp)) {}

DistributedModel::DistributedModel(std::shared_ptr<torch::nn::Module> module, ForwardFn forward,
                                   DistributedModelOptions options, ProcessGroupPtr dp)
    : impl_(std::make_unique<Impl>()) {
  SMP_CHECK(module, "DistributedModel: the module is null");
  impl_->module = std::move(module);
  impl_->forward = std::move(forward);
  impl_->opts = options;
  if (!dp) dp = runtime().groups().dp;
  impl_->pg = std::move(dp);
  if (impl_->opts.timeout_s <= 0)
    impl_->opts.timeout_s = is_initialized() ? runtime().config().timeout_s : 300.0;
  for (auto& p : impl_->module->parameters())
    if (p.requires_grad()) impl_->params.push_back(p);
  ReducerOptions ro;
  ro.bucket_cap_bytes = options.bucket_cap_bytes;
  ro.gradient_as_bucket_view = options.gradient_as_bucket_view;
  ro.overlapping = options.overlapping;
  ro.shared_memory = options.shared_memory;
  ro.timeout_s = impl_->opts.timeout_s;
  impl_->reducer = std::make_unique<Reducer>(impl_->params, impl_->pg, ro);
}

DistributedModel::~DistributedModel() = default;

at::Tensor DistributedModel::forward(const at::Tensor& input) {
  auto& I = *impl_;
  if (!I.synced) {
    std::vector<at::Tensor> all;
    for (auto& p : I.module->parameters()) all.push_back(p);
    for (auto& b : I.buffers()) all.push_back(b);
    broadcast_coalesced(I.pg, all, 0, kDefaultBucketBytesCap, I.opts.timeout_s);
    I.synced = true;
  } else if (I.opts.broadcast_buffers) {
    auto bufs = I.buffers();
    if (!bufs.empty()) broadcast_coalesced(I.pg, bufs, 0, kDefaultBucketBytesCap, I.opts.timeout_s);
  }
  return I.forward(input);
}

ReducerStats DistributedModel::backward(const at::Tensor& loss, bool sync) {
  impl_->reducer->prepare_for_backward(sync, 1.0, {loss});
  loss.backward();
  return sync ? impl_->reducer->finalize() : ReducerStats{};
}

void DistributedModel::register_comm_hook(CommHookPtr hook) {
  impl_->reducer->register_comm_hook(std::move(hook));
}

torch::nn::Module& DistributedModel::module() { return *impl_->module; }
const std::vector<at::Tensor>& DistributedModel::parameters() const { return impl_->params; }
Reducer& DistributedModel::reducer() { return *impl_->reducer; }
const ProcessGroupPtr& DistributedModel::process_group() const { return impl_->pg; }

}  // namespace smp
