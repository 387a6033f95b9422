// PowerSGD gradient compression (Vogels et al., 2019, arXiv:1905.13727) as C++ comm
// hooks, the counterparts of torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook:
// the same hyperparameters, the same state and the same random sequence for a given
// seed, so training matches torch's hook where torch's runs (see docs/powersgd.md).
//
// Each bucket costs three collectives, issued in this order from run() on the
// reducer's comm thread: the uncompressed rest, P, then Q. run() waits for P (bounded
// by timeout_s) before it computes and issues Q, and completion callbacks only notify,
// so the sequence of collectives is the same on every rank whatever the bucket count
// or timing (Note [Ordered bucket communication] in smp_core/comm_queue.h).
// Decompression and error feedback run in result().
//
// Threads: one PowerSGDState serves one reducer (one dp group). run() and result() of
// different buckets may overlap (comm thread and training thread); the state guards
// itself. snapshot()/restore() and the accessors may be called from any thread, but
// give a consistent picture only between steps.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/comm.h"
#include "smp_core/grad_bucket.h"

namespace smp::hooks {

struct PowerSGDOptions {
  // Rank of the low-rank approximation M ~ P Q^T; higher is more exact, costs more.
  int64_t matrix_approximation_rank = 1;
  // Steps (synchronized, counted at the last bucket) of plain averaging before
  // compression starts. Must be > 1 with error feedback or warm start.
  int64_t start_powerSGD_iter = 1000;
  // A tensor is compressed only if (n + m) * rank * min_compression_rate < n * m.
  double min_compression_rate = 2;
  // Add what compression lost last step to this step's gradient.
  bool use_error_feedback = true;
  // Start each step's power iteration from last step's Q (else a fresh random Q).
  bool warm_start = true;
  // Added to every column norm in orthogonalization (0: none; NaN on a zero column).
  double orthogonalization_epsilon = 0;
  // Seeds the generator of the initial Qs (numpy's legacy RandomState, as torch).
  uint32_t random_seed = 0;
  // Steps between compression-stats reports (at least 1).
  int64_t compression_stats_logging_frequency = 10000;
  // Compress same-shaped tensors of a bucket as one batch (stacked).
  bool batch_tensors_with_same_shape = false;
  // Seconds run() may wait for the P allreduce of one bucket.
  double timeout_s = 300.0;
};

// Throws ConfigError naming the first bad option (rank < 1, start_powerSGD_iter <= 1
// with error feedback or warm start, timeout_s <= 0).
void validate(const PowerSGDOptions& options);

// The state a checkpoint holds, in torch's PowerSGDState field names. `rng_key`/
// `rng_pos` are the MT19937 state of numpy's RandomState(random_seed) (numpy's
// get_state()[1:3]). snapshot() hands out the state's own tensors, which the hooks
// update in place: copy them to keep them.
struct PowerSGDSnapshot {
  PowerSGDOptions options;
  std::vector<uint32_t> rng_key;  // 624 words
  int64_t rng_pos = 624;
  int64_t iter = 0;
  int64_t total_numel_before_compression = 0;
  int64_t total_numel_after_compression = 0;
  int64_t next_stats_report = 0;
  std::map<int64_t, at::Tensor> error_dict, p_memory_dict, q_memory_dict;
};

// Algorithm state shared by powersgd_hook/batched_powersgd_hook over one dp group.
class PowerSGDState {
 public:
  // `pg` null: each bucket's own group (the reducer's). Validates `options`.
  explicit PowerSGDState(PowerSGDOptions options = {}, ProcessGroupPtr pg = {});
  ~PowerSGDState();
  PowerSGDState(const PowerSGDState&) = delete;
  PowerSGDState& operator=(const PowerSGDState&) = delete;

  const PowerSGDOptions& options() const;
  const ProcessGroupPtr& process_group() const;
  void set_process_group(ProcessGroupPtr pg);
  void set_timeout(double timeout_s);

  int64_t iter() const;
  // (numel before / numel after, numel before, numel after) over the compressed steps,
  // as torch's compression_stats(); the rate is 0 before any compression.
  std::tuple<double, int64_t, int64_t> compression_stats() const;
  // Bytes this rank handed to collectives through the hooks, all steps (vanilla ones
  // included): what was actually sent into the allreduces.
  int64_t bytes_allreduced() const;
  // Compression-stats reports so far (every compression_stats_logging_frequency steps).
  int64_t stats_reports() const;

  PowerSGDSnapshot snapshot() const;
  // Replaces the state with a copy of `s` (options included, validated); keeps the
  // process group.
  void restore(const PowerSGDSnapshot& s);

  // For the hooks in powersgd.cpp.
  struct Impl;
  Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

using PowerSGDStatePtr = std::shared_ptr<PowerSGDState>;

// torch's powerSGD_hook: per-tensor rank-r compression of the bucket's matrices.
CommHookPtr powersgd_hook(PowerSGDStatePtr state);
// torch's batched_powerSGD_hook: the whole bucket as one zero-padded square matrix.
CommHookPtr batched_powersgd_hook(PowerSGDStatePtr state);

}  // namespace smp::hooks
