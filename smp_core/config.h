// smp configuration: the keys of `smp.init(config)` (API.md), parsed and validated
// here so that Python and C++ programs get the same rules and the same messages.
//
// Thread-safety: a Config is a plain value; parse once, then share read-only.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "smp_core/errors.h"

namespace smp {

struct Config {
  // Pipeline stages a model replica is split into (alias: pipeline_parallel_degree).
  int partitions = 1;
  // Microbatches a step's batch is split into.
  int microbatches = 1;
  // Pipeline schedule: "interleaved", "simple", "1f1b" or "zero_bubble" (smp_core/plan.h).
  std::string pipeline = "interleaved";
  // "dynamic": no step executes a list; each is ordered by the plans' rule as its work
  // becomes ready (Note [Order without a list] in smp_core/plan.cpp);
  // "planned" (the default): from the second training step on, the compiled plan is
  // executed as written (Note [Executed plan] in smp_core/detail/plan_execution.cpp).
  std::string pipeline_order = "planned";
  // Data parallelism over replicas through smp's reducer.
  bool ddp = false;
  // Ranks that split each stage's distributed modules (SMP v1.6+; smp_core/topology.h):
  // the world is partitions x tensor_parallel_degree x rdp.
  int tensor_parallel_degree = 1;
  // The ranks of a tp group read the same batch (SMP's prescaled_batch).
  bool prescaled_batch = false;
  // smp.model_creation() builds the model without parameter storage, as inside
  // smp.delay_param_initialization() (SMP's delayed_parameter_initialization).
  bool delayed_parameter_initialization = false;
  // SMP's offload_activations: activations in host memory (a CPU model's are; a CUDA
  // model is refused at its first step).
  bool offload_activations = false;
  // Rank layout: "cluster" (= "DPT") or "spread" (= "TPD"), or a permutation of D, P, T.
  std::string placement_strategy = "cluster";
  // "speed" or "memory": sets the default memory_weight (0.2 or 0.8, as SMP does).
  std::string optimize = "speed";
  // Auto-partition; when false, smp.partition() contexts and default_partition decide.
  bool auto_partition = true;
  // Partition of modules outside any smp.partition() context (auto_partition=false).
  int default_partition = 0;
  // Weight of memory balance vs compute balance in [0,1]; default from `optimize`.
  double memory_weight = 0.2;
  // Microbatches in flight at once; default partitions + 2.
  int active_microbatches = 3;
  // Partitions are contiguous in execution order (the only supported mode).
  bool contiguous = true;
  // Process-group backend: "auto" (nccl with CUDA, else gloo), "gloo", "nccl".
  std::string backend = "auto";
  // Seconds every blocking wait may take before it fails naming what it awaited.
  double timeout_s = 300.0;
  // Where pipeline tensors travel: "auto" (CPU tensors on the TCP mesh, CUDA tensors by
  // c10d send/recv), "tcp" (CPU only), "c10d" (every tensor by c10d send/recv).
  std::string p2p_transport = "auto";
  // Skip the tracing pass (SMP v1.6+); the partitioner then uses parameter sizes only.
  bool skip_tracing = false;
  // Each dp rank keeps the optimizer state of its share of the parameters (SMP v1.6+;
  // Note [Sharded optimizer state] in python/smp/optimizer_sharding.py).
  bool shard_optimizer_state = false;
  // Mixed precision (SMP v1.10): the model's floating-point parameters and buffers are
  // kept in fp16 (loss-scaled, fp32 master weights in smp.DistributedOptimizer) or bf16
  // on their owner after partitioning. At most one of the two.
  bool fp16 = false;
  bool bf16 = false;
  // Where smp.save_checkpoint writes, and where a (re)started job resumes from by itself
  // (Note [Automatic resume] in python/smp/auto_resume.py); "" = none. smprun's
  // --checkpoint_dir sets it too (SMP_CHECKPOINT_DIR); this key wins.
  std::string checkpoint_dir;
  // Compatibility keys smp accepts but does not use (ddp_port, ...), as given: a JSON
  // object, so SMP clients read them back through smp.state.cfg.
  std::string ignored_json = "{}";

  // Parses a JSON object; validates every key (unknown keys get a did-you-mean) and
  // resolves defaults that depend on other keys. `rank` >= 0 is named in messages.
  // Throws ConfigError.
  static Config from_json(const std::string& json, int rank = -1);

  // Canonical JSON of the resolved config: sorted keys, every key present, also under
  // SMP's names (pipeline_parallel_degree, ddp_dist_backend) and with SMP's keys that
  // smp accepts only at their neutral value (fp16, prescaled_batch, ...) at that value.
  std::string to_json() const;

  // FNV-1a hash of to_json(): equal on ranks that agree.
  uint64_t hash() const;

  // Checks against the job's world size (partitions, then tensor_parallel_degree, divide
  // it). Throws ConfigError.
  void validate_world(int world_size, int rank = -1) const;
};

// The keys Config::from_json accepts (canonical names, sorted).
std::vector<std::string> config_keys();

// Given each rank's outcome of Config::from_json (either canonical JSON or an error
// message prefixed "error:"), returns "" if all ranks agree, else one message that
// names the first differing key and which ranks hold which value (or which rank's
// config was invalid). Used by every rank on the same input, so all raise alike.
std::string describe_config_disagreement(const std::vector<std::string>& per_rank);

// An on/off switch in the environment (smp_common parse_flag): unset or empty gives
// `fallback`, "1" on, "0" off; anything else throws ConfigError naming the variable, the
// value, {0, 1} and `meaning` (what 1 does).
bool env_flag(const char* name, bool fallback, const char* meaning);

}  // namespace smp
