// Data-parallel training of a small MLP with the smp C++ API.
//
//   smprun --nproc_per_node 2 build/bin/cpp_ddp_example [--steps N] [--hook NAME]
//          [--bucket-view]
//   build/bin/cpp_ddp_example          (no launcher: a world of 1)
//
// Each rank draws its own batches; smp::DistributedModel averages the gradients, so
// the replicas stay identical (checked at the end) and learn y = 0.5 * sum(sin(x)).
// --hook: a built-in comm hook (allreduce, fp16_compress, bf16_compress, noop).
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "hooks/builtin.h"
#include "smp_core/comm.h"
#include "smp_core/distributed_model.h"
#include "smp_core/runtime.h"

int main(int argc, char** argv) {
  int steps = 200;
  std::string hook;
  bool bucket_view = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (a == "--hook" && i + 1 < argc) {
      hook = argv[++i];
    } else if (a == "--bucket-view") {
      bucket_view = true;
    } else {
      std::fprintf(stderr, "usage: %s [--steps N] [--hook NAME] [--bucket-view]\n", argv[0]);
      return 2;
    }
  }
  try {
    smp::Runtime& rt = smp::init();
    const int rank = rt.rank();
    torch::set_num_threads(1);
    // Different initial weights per rank: the first forward broadcasts rank 0's.
    torch::manual_seed(1000 + rank);
    auto net = torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::ReLU(),
                                     torch::nn::Linear(64, 64), torch::nn::ReLU(),
                                     torch::nn::Linear(64, 1));
    smp::DistributedModelOptions opts;
    opts.gradient_as_bucket_view = bucket_view;
    opts.bucket_cap_bytes = 8 << 10;  // small model: several buckets, to overlap
    smp::DistributedModel model(net.ptr(), opts);
    if (!hook.empty()) model.register_comm_hook(smp::hooks::make_builtin_hook(hook));
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));

    double loss_v = 0;
    for (int step = 0; step < steps; ++step) {
      auto x = torch::randn({32, 16});
      auto y = 0.5 * x.sin().sum(1, true);
      auto loss = torch::mse_loss(model(x), y);
      model.backward(loss);
      opt.step();
      opt.zero_grad();
      loss_v = loss.item<double>();
      if (rank == 0 && (step % 50 == 0 || step == steps - 1))
        std::printf("step %d loss %.5f\n", step, loss_v);
    }

    // The replicas must hold identical parameters.
    double sum = 0;
    for (auto& p : net->parameters()) sum += p.detach().to(torch::kDouble).abs().sum().item<double>();
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.12e", sum);
    auto all = smp::allgather_bytes(model.process_group(), buf, rt.config().timeout_s,
                                    "the parameter checksum");
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r] != all[0]) {
        std::fprintf(stderr, "replica %zu differs: %s vs %s\n", r, all[r].c_str(), all[0].c_str());
        return 1;
      }
    }
    if (rank == 0)
      std::printf("done: %d steps on %zu ranks, final loss %.5f, replicas identical\n", steps,
                  all.size(), loss_v);
    smp::shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpp_ddp_example: %s\n", e.what());
    return 1;
  }
  return 0;
}
