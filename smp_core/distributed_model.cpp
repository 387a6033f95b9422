#include "smp_core/distributed_model.h"

#include <torch/torch.h>

#include "smp_core/errors.h"
#include "smp_core/replica_step.h"
#include "smp_core/runtime.h"

namespace smp {

struct DistributedModel::Impl {
  std::shared_ptr<torch::nn::Module> module;
  ForwardFn forward;
  DistributedModelOptions opts;
  ProcessGroupPtr pg;
  std::vector<at::Tensor> params;
  std::unique_ptr<Reducer> reducer;
  std::unique_ptr<ReplicaStep> step;  // the step policy, shared with Python's Replica

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
  ReplicaStepOptions so;
  so.broadcast_buffers = options.broadcast_buffers;
  so.timeout_s = impl_->opts.timeout_s;
  impl_->step = std::make_unique<ReplicaStep>(impl_->pg, so);
}

DistributedModel::~DistributedModel() = default;

at::Tensor DistributedModel::forward(const at::Tensor& input) {
  auto& I = *impl_;
  std::vector<at::Tensor> params;
  for (auto& p : I.module->parameters()) params.push_back(p);
  I.step->sync_before_forward(params, I.buffers());
  return I.forward(input);
}

ReducerStats DistributedModel::backward(const at::Tensor& loss, bool sync) {
  auto& I = *impl_;
  I.step->begin_step();
  I.step->set_sync_step(sync);  // the caller decides each step (no backward_passes_per_step)
  I.step->begin_microbatch(/*last=*/true);
  I.step->prepare_for_backward(*I.reducer, {loss});
  try {
    loss.backward();
  } catch (const std::exception& e) {
    // The peers raise in this step's reduction, naming this rank, instead of waiting
    // for it until the timeout (Note [Failed rank] in detail/reducer_shadow.cpp); a
    // step that does not synchronize has no collective to tell them in.
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    I.step->fail_step(I.reducer.get(), I.step->sync_step(), I.step->armed(), what);
    throw;
  }
  return I.step->end_step(I.reducer.get());
}

void DistributedModel::register_comm_hook(CommHookPtr hook) {
  impl_->reducer->register_comm_hook(std::move(hook));
}

torch::nn::Module& DistributedModel::module() { return *impl_->module; }
const std::vector<at::Tensor>& DistributedModel::parameters() const { return impl_->params; }
Reducer& DistributedModel::reducer() { return *impl_->reducer; }
const ProcessGroupPtr& DistributedModel::process_group() const { return impl_->pg; }

}  // namespace smp
