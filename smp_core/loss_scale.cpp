#include "smp_core/loss_scale.h"

#include <cmath>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "smp_core/errors.h"

namespace smp {

// Note [One overflow decision]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With fp16 the loss is scaled on the driver, so every stage's gradients carry the
// driver's scale. Whether a step overflowed is one decision for the job: a stage that
// skipped its step while another took it would leave their weights from different
// steps and their scales apart (every later gradient unscaled by the wrong number),
// silently. So each rank sums its gradients in double (an inf or a nan survives the sum;
// finite fp16, bf16 or fp32 values cannot overflow a double's range), turns that into a
// 0/1 flag and one one-element MAX allreduce over every rank holding part of the model
// (the pp group; the world with sharded optimizer state, where each dp rank keeps only
// its share of the gradients) gives every rank the same answer. At pp > 1 it runs in the
// step's finish (Dispatcher::finish_at_step_end), after the tied sum and the dp
// reduction, so the gradients are final; the optimizer step, the scaler's update and
// `optimizer.overflow` read it. The scale then moves by the same rule on every rank
// (LossScaler), so it stays equal without being sent.

LossScaler LossScaler::fixed(double scale) {
  if (!(scale > 0) || !std::isfinite(scale))
    throw ConfigError(str_cat("smp: DistributedOptimizer static_loss_scale=", scale,
                              " is not allowed (allowed: a finite number > 0)"));
  LossScaler s;
  s.state_.scale = scale;
  return s;
}

namespace {
const char* const kDynamicKeys[] = {"init_scale", "scale_factor", "scale_window",
                                    "min_scale", "delayed_shift", "consecutive_hysteresis"};

[[noreturn]] void bad_arg(const std::string& key, double v, const std::string& allowed) {
  throw ConfigError(str_cat("smp: DistributedOptimizer dynamic_loss_args['", key, "']=", v,
                            " is not allowed (allowed: ", allowed, ")"));
}

int64_t whole(const std::string& key, double v) {
  if (!(v >= 1) || v != std::trunc(v) || v > 9e15) bad_arg(key, v, "an integer >= 1");
  return static_cast<int64_t>(v);
}
}  // namespace

LossScaler LossScaler::dynamic(const std::map<std::string, double>& args) {
  LossScaler s;
  s.dynamic_ = true;
  Options& o = s.options_;
  for (const auto& [key, v] : args) {
    if (key == "init_scale") {
      if (!(v > 0) || !std::isfinite(v)) bad_arg(key, v, "a finite number > 0");
      o.init_scale = v;
    } else if (key == "scale_factor") {
      if (!(v > 1) || !std::isfinite(v)) bad_arg(key, v, "a finite number > 1");
      o.scale_factor = v;
    } else if (key == "scale_window") {
      o.scale_window = whole(key, v);
    } else if (key == "min_scale") {
      if (!(v > 0) || !std::isfinite(v)) bad_arg(key, v, "a finite number > 0");
      o.min_scale = v;
    } else if (key == "delayed_shift") {
      o.delayed_shift = whole(key, v);
    } else if (key == "consecutive_hysteresis") {
      if (v != 0 && v != 1) bad_arg(key, v, "true or false");
      o.consecutive_hysteresis = v != 0;
    } else {
      std::string allowed;
      for (const char* k : kDynamicKeys) allowed += str_cat(allowed.empty() ? "" : ", ", k);
      throw ConfigError(str_cat("smp: DistributedOptimizer dynamic_loss_args has an unknown "
                                "key '", key, "' (allowed: ", allowed, ")"));
    }
  }
  if (o.init_scale < o.min_scale)
    throw ConfigError(str_cat("smp: DistributedOptimizer dynamic_loss_args['init_scale']=",
                              o.init_scale, " is below min_scale=", o.min_scale,
                              " (allowed: init_scale >= min_scale)"));
  s.state_.scale = o.init_scale;
  s.state_.hysteresis = o.delayed_shift;
  return s;
}

void LossScaler::update(bool overflow) {
  if (!dynamic_) return;
  State& st = state_;
  if (overflow) {
    // Hysteresis: the first delayed_shift - 1 overflows (in a row, with
    // consecutive_hysteresis) only use up the allowance; the next one shifts.
    if (options_.delayed_shift == 1 || st.hysteresis == 1)
      st.scale = std::max(st.scale / options_.scale_factor, options_.min_scale);
    else
      --st.hysteresis;
    st.last_overflow_iter = st.iter;
  } else {
    if (options_.consecutive_hysteresis) st.hysteresis = options_.delayed_shift;
    if ((st.iter - st.last_overflow_iter) % options_.scale_window == 0) {
      if (!options_.consecutive_hysteresis) st.hysteresis = options_.delayed_shift;
      st.scale *= options_.scale_factor;
    }
  }
  ++st.iter;
}

void LossScaler::set_state(const State& s) {
  if (!(s.scale > 0) || !std::isfinite(s.scale) || s.hysteresis < 0 || s.iter < 0)
    throw ConfigError(str_cat("smp: loss scaler state (scale=", s.scale, ", iter=", s.iter,
                              ", hysteresis=", s.hysteresis, ") is not a valid state"));
  state_ = s;
}

OverflowCheck::OverflowCheck(std::vector<at::Tensor> params, ProcessGroupPtr group,
                             double timeout_s)
    : params_(std::move(params)), group_(std::move(group)), timeout_s_(timeout_s) {}

bool OverflowCheck::any_nonfinite(const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> sums;
  sums.reserve(grads.size());
  for (const at::Tensor& g : grads) {
    if (!g.defined() || g.numel() == 0 || !at::isFloatingType(g.scalar_type())) continue;
    sums.push_back(at::sum(g.detach(), at::kDouble));
  }
  if (sums.empty()) return false;
  return !std::isfinite(at::stack(sums).sum().item<double>());
}

bool OverflowCheck::run() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  grads.reserve(params_.size());
  for (const at::Tensor& p : params_) grads.push_back(p.grad());
  bool found = any_nonfinite(grads);
  if (group_) {
    const auto device = params_.empty() ? at::Device(at::kCPU) : params_.front().device();
    std::vector<at::Tensor> flag{
        at::full({1}, found ? 1.0 : 0.0, at::TensorOptions().dtype(at::kFloat).device(device))};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    wait_work(group_->allreduce(flag, opts), timeout_s_,
              "the agreement on whether this step's gradients overflowed (inf or nan)");
    found = flag[0].item<float>() != 0.0f;
  }
  ++runs_;
  last_ = found;
  return found;
}

std::optional<bool> OverflowCheck::take() { return std::exchange(last_, std::nullopt); }

}  // namespace smp
