// smp::DistributedModel: data parallelism for libtorch programs. Wraps a module
// replicated on every rank of a dp process group; gradients are averaged by the
// Reducer (buckets, overlap with backward, comm hooks), as smp.DistributedModel with
// partitions=1 does in Python, with the same step policy (smp::ReplicaStep,
// replica_step.h: what each forward broadcasts, arming and finalizing the reducer).
// See docs/reducer.md.
//
//   smp::init();
//   auto net = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::ReLU(), ...);
//   smp::DistributedModel model(net.ptr());
//   torch::optim::SGD opt(net->parameters(), 0.1);
//   auto loss = torch::mse_loss(model.forward(x), y);
//   model.backward(loss);  // averaged .grad on every rank
//   opt.step(); opt.zero_grad();
//
// Collective: every rank of the group constructs, calls forward and backward in the
// same sequence (the constructor checks that all ranks hold the same parameters).
// Thread-safety: one training thread.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/comm.h"
#include "smp_core/grad_bucket.h"
#include "smp_core/reducer.h"

namespace torch::nn {
class Module;
class SequentialImpl;
}  // namespace torch::nn

namespace smp {

struct DistributedModelOptions {
  // Bytes per gradient bucket (see ReducerOptions).
  size_t bucket_cap_bytes = kDefaultBucketBytesCap;
  // Make each param.grad a view of its bucket slice: no copy in or out.
  bool gradient_as_bucket_view = false;
  // Launch bucket communication during backward.
  bool overlapping = true;
  // Sum buckets in shared memory when all ranks share this host (ReducerOptions).
  bool shared_memory = true;
  // Broadcast buffers from dp rank 0 before every forward (parameters and buffers
  // are always broadcast before the first).
  bool broadcast_buffers = true;
  // Seconds any wait may take; 0: the runtime's timeout_s when initialized, else 300.
  double timeout_s = 0;
};

class DistributedModel {
 public:
  using ForwardFn = std::function<at::Tensor(const at::Tensor&)>;

  // `dp` null: smp::runtime().groups().dp (throws if smp is not initialized).
  explicit DistributedModel(std::shared_ptr<torch::nn::SequentialImpl> module,
                            DistributedModelOptions options = {}, ProcessGroupPtr dp = {});
  // Any module, with the function that runs it.
  DistributedModel(std::shared_ptr<torch::nn::Module> module, ForwardFn forward,
                   DistributedModelOptions options = {}, ProcessGroupPtr dp = {});
  ~DistributedModel();

  DistributedModel(const DistributedModel&) = delete;
  DistributedModel& operator=(const DistributedModel&) = delete;

  // Runs the module. The first call broadcasts parameters and buffers from dp rank 0.
  at::Tensor forward(const at::Tensor& input);
  at::Tensor operator()(const at::Tensor& input) { return forward(input); }

  // loss.backward() with gradient reduction. sync=false only accumulates (no_sync):
  // the next backward with sync=true reduces the sum. Returns the step's stats (zero
  // when sync=false).
  ReducerStats backward(const at::Tensor& loss, bool sync = true);

  // See Reducer::register_comm_hook (once, before the first backward).
  void register_comm_hook(CommHookPtr hook);

  torch::nn::Module& module();
  // The parameters that require grad, in registration order (the reducer's indices).
  const std::vector<at::Tensor>& parameters() const;
  Reducer& reducer();
  const ProcessGroupPtr& process_group() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace smp
