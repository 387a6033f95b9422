// Mixed precision's two decisions, in C++ (Note [One overflow decision] in
// loss_scale.cpp): whether this step's gradients overflowed, agreed by every rank that
// holds part of the model (OverflowCheck), and how the fp16 loss scale moves after it
// (LossScaler, SMP v1.10's static and dynamic loss scaling).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/comm.h"

namespace smp {

// The loss scale of fp16 training. Static: a constant scale, never an overflow.
// Dynamic (SMP v1.10's `dynamic_loss_args`, the rules of Megatron's and apex's
// DynamicLossScaler): an overflow divides the scale by `scale_factor` (not below
// `min_scale`) once `delayed_shift` overflows have been absorbed (hysteresis); each
// `scale_window` steps without an overflow multiply it by `scale_factor`.
class LossScaler {
 public:
  struct Options {
    double init_scale = 4294967296.0;  // 2**32
    double scale_factor = 2.0;
    int64_t scale_window = 1000;
    double min_scale = 1.0;
    int64_t delayed_shift = 1;
    bool consecutive_hysteresis = false;
  };
  // What the scale has been through: a resume restores it (bitwise).
  struct State {
    double scale = 1.0;
    int64_t iter = 0;                 // updates so far
    int64_t last_overflow_iter = -1;  // the update of the last overflow (-1: none)
    int64_t hysteresis = 1;           // overflows still absorbed before a shift
  };

  // A static scale (> 0).
  static LossScaler fixed(double scale);
  // A dynamic scaler from SMP's `dynamic_loss_args` (every key optional; booleans as
  // 0/1). Throws ConfigError naming an unknown key or a bad value, and the allowed ones.
  static LossScaler dynamic(const std::map<std::string, double>& args);

  bool is_dynamic() const { return dynamic_; }
  double scale() const { return state_.scale; }
  const Options& options() const { return options_; }
  // After a step whose overflow the whole job agreed on: a static scaler stays.
  void update(bool overflow);
  State state() const { return state_; }
  void set_state(const State& s);

 private:
  LossScaler() = default;
  bool dynamic_ = false;
  Options options_;
  State state_;
};

// Whether any gradient of `params` is inf or nan on any rank of `group` (null: this
// rank only). run() is collective over the group: every rank calls it at the same
// point of the same step (Dispatcher::finish_at_step_end, or the main thread).
class OverflowCheck {
 public:
  OverflowCheck(std::vector<at::Tensor> params, ProcessGroupPtr group, double timeout_s);

  // Checks this rank's gradients, agrees with the group, keeps and returns the answer.
  bool run();
  // The answer of the last run() since take(), if any.
  std::optional<bool> last() const { return last_; }
  // The last answer, forgotten (the optimizer step consumed it).
  std::optional<bool> take();
  // Runs so far (each a one-element allreduce when there is a group).
  int64_t runs() const { return runs_; }

  // Whether `grads` hold an inf or a nan (this rank only; undefined ones skipped).
  static bool any_nonfinite(const std::vector<at::Tensor>& grads);

 private:
  std::vector<at::Tensor> params_;
  ProcessGroupPtr group_;
  double timeout_s_;
  std::optional<bool> last_;
  int64_t runs_ = 0;
};

}  // namespace smp
