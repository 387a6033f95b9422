#include "hooks/quantization_hooks.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <limits>
#include <map>
#include <mutex>

#include "hooks/builtin.h"
#include "smp_core/errors.h"

namespace smp::hooks {
namespace {

constexpr double kQuantMin = 0, kQuantMax = 255;  // quint8, reduce_range=False

// torch's ObserverBase._calculate_qparams for per_tensor/per_channel_affine quint8,
// on aminmax results of any shape: (scale float32, zero point float32) elementwise.
std::pair<at::Tensor, at::Tensor> qparams(const at::Tensor& min_val, const at::Tensor& max_val) {
  at::Tensor min_neg = at::min(min_val, at::zeros_like(min_val));
  at::Tensor max_pos = at::max(max_val, at::zeros_like(max_val));
  at::Tensor eps = at::full({1}, std::numeric_limits<float>::epsilon(), min_neg.options());
  at::Tensor scale = (max_pos - min_neg) / (kQuantMax - kQuantMin);
  scale = at::max(scale, eps);
  // quant_min - round(min / scale) in int32, as torch (quant_min is 0).
  at::Tensor zp = at::neg(at::round(min_neg / scale).to(at::kInt));
  zp = at::clamp(zp, static_cast<int64_t>(kQuantMin), static_cast<int64_t>(kQuantMax));
  return {scale.to(at::kFloat), zp.to(at::kFloat)};
}

// One bucket between run() and result().
struct Pending {
  at::Tensor buffer;
  std::vector<at::Tensor> s_and_z;     // per rank: [2] or [2, channels]
  std::vector<at::Tensor> quantized;   // per rank: uint8 like the quantized input
};

class QuantizationHook : public CommHook {
 public:
  // channel_size 0: per tensor.
  QuantizationHook(ProcessGroupPtr state, int64_t channel_size, double timeout_s)
      : state_(std::move(state)),
        per_tensor_(channel_size == 0),
        channel_size_(channel_size),
        timeout_s_(timeout_s) {}

  FuturePtr run(GradBucket& bucket) override {
    const ProcessGroupPtr& pg = state_ ? state_ : bucket.process_group();
    const int world = pg->getSize();
    const int rank = pg->getRank();
    auto p = std::make_shared<Pending>();
    p->buffer = bucket.buffer();
    at::Tensor x = p->buffer;
    at::Tensor s_and_z;
    // The observers look at a float32 copy; the quantization uses the gradients as they are.
    if (per_tensor_) {
      auto [mn, mx] = at::aminmax(x.to(at::kFloat));
      auto [s, z] = qparams(mn, mx);
      s_and_z = at::stack({s.reshape({}), z.reshape({})}).to(at::kFloat);
    } else {
      const int64_t n = x.numel();
      x = at::constant_pad_nd(x, {0, channel_size_ - n % channel_size_}, 0)
              .view({-1, channel_size_});
      auto [mn, mx] = at::aminmax(x.to(at::kFloat), 1);
      auto [s, z] = qparams(mn, mx);
      s_and_z = at::stack({s, z});
    }
    p->s_and_z = gather(pg, s_and_z, world, bucket, "scale and zero point");
    at::Tensor scale = p->s_and_z[rank][0], zp = p->s_and_z[rank][1];
    if (!per_tensor_) {
      scale = scale.unsqueeze(1);
      zp = zp.unsqueeze(1);
    }
    // torch's _quantize_per_tensor_cuda / _quantize_per_channel_cuda.
    at::Tensor q = at::clamp(at::round(x / scale) + zp, 0, 255).to(at::kByte);
    std::vector<at::Tensor> in{q};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < world; ++r) out[0].push_back(at::zeros_like(q));
    p->quantized = out[0];
    FuturePtr fut = pg->allgather(out, in)->getFuture();
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_[bucket.index()] = p;
    }
    return fut;
  }

  at::Tensor result(GradBucket& bucket, const c10::IValue&) override {
    std::shared_ptr<Pending> p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(bucket.index());
      SMP_CHECK(it != pending_.end(), name(), ": result() without run() for bucket ",
                bucket.index());
      p = std::move(it->second);
      pending_.erase(it);
    }
    const int64_t world = static_cast<int64_t>(p->quantized.size());
    at::Tensor agg = at::zeros_like(p->quantized[0], p->quantized[0].options().dtype(at::kFloat));
    for (int64_t r = 0; r < world; ++r) {
      at::Tensor scale = p->s_and_z[r][0], zp = p->s_and_z[r][1];
      if (!per_tensor_) {
        scale = scale.unsqueeze(1);
        zp = zp.unsqueeze(1);
      }
      agg += scale * (p->quantized[r].to(at::kFloat) - zp);
    }
    if (!per_tensor_) agg = at::flatten(agg).narrow(0, 0, p->buffer.numel());
    return agg / world;
  }

  std::string name() const override {
    return builtin_hook_name(per_tensor_ ? BuiltinCommHookType::kQuantizePerTensor
                                         : BuiltinCommHookType::kQuantizePerChannel);
  }
  bool issues_all_in_run() const override { return true; }

 private:
  // Allgathers `t` and waits (we are on the comm thread: waiting orders collectives).
  std::vector<at::Tensor> gather(const ProcessGroupPtr& pg, const at::Tensor& t, int world,
                                 const GradBucket& bucket, const char* what) {
    std::vector<at::Tensor> in{t};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < world; ++r) out[0].push_back(at::zeros_like(t));
    FuturePtr fut = pg->allgather(out, in)->getFuture();
    wait_future(fut, timeout_s_,
                str_cat("the ", what, " allgather of bucket ", bucket.index(), " (comm hook '",
                        name(), "') on ", pg->getBackendName(), " rank ", pg->getRank(),
                        " of ", world));
    return out[0];
  }

  ProcessGroupPtr state_;
  bool per_tensor_;
  int64_t channel_size_;
  double timeout_s_;
  std::mutex mu_;
  std::map<size_t, std::shared_ptr<Pending>> pending_;  // by bucket index
};

}  // namespace

CommHookPtr quantization_pertensor_hook(ProcessGroupPtr state, double timeout_s) {
  return std::make_shared<QuantizationHook>(std::move(state), 0, timeout_s);
}

CommHookPtr quantization_perchannel_hook(ProcessGroupPtr state, int64_t channel_size,
                                         double timeout_s) {
  if (channel_size < 1)
    throw ConfigError(str_cat("smp: quantization_perchannel_hook bucket_size=", channel_size,
                              " must be >= 1"));
  return std::make_shared<QuantizationHook>(std::move(state), channel_size, timeout_s);
}

}  // namespace smp::hooks
