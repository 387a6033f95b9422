// Job shape defaults read from a scheduler's environment (SLURM, Open MPI, SageMaker).
//
// Every function here is pure: it reads only the EnvMap it is given, so each mapping is
// unit-tested without a scheduler. A mapping fills only the fields its scheduler knows;
// explicit smprun flags always win over them (see Note [Default precedence] in options.cpp).
// The mappings are documented for users in docs/launcher.md.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "smp_common/env.h"

namespace smp::launcher {

using EnvMap = common::EnvMap;

// What one source of defaults says about the job; unset fields are unknown.
struct SchedulerDefaults {
  // Which source filled this ("slurm", "openmpi", "sagemaker", "env"); empty if none.
  std::string source;
  std::optional<int> nnodes;
  std::optional<int> node_rank;
  std::optional<int> nproc_per_node;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  std::optional<std::string> job_id;
  // Set when the environment is recognised but unusable (e.g. SM_CURRENT_HOST not in
  // SM_HOSTS); the launcher reports it as a bad-input error.
  std::string error;

  bool empty() const {
    return !nnodes && !node_rank && !nproc_per_node && !master_addr && !master_port && !job_id &&
           error.empty();
  }
};

// SLURM: SLURM_NNODES (or SLURM_JOB_NUM_NODES) -> nnodes, SLURM_NODEID -> node_rank,
// SLURM_NTASKS_PER_NODE ("4" or "4(x2),2") -> nproc_per_node, first host of
// SLURM_JOB_NODELIST (or SLURM_NODELIST) -> master_addr, SLURM_JOB_ID -> job_id.
SchedulerDefaults slurm_defaults(const EnvMap& env);

// Open MPI, one smprun per node (mpirun --map-by ppr:1:node): OMPI_COMM_WORLD_SIZE /
// OMPI_COMM_WORLD_LOCAL_SIZE -> nnodes, OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_LOCAL_SIZE
// -> node_rank, OMPI_MCA_ess_base_jobid -> job_id. A local size above 1 (several
// launchers on one node) is an error. Open MPI does not name a master host.
SchedulerDefaults openmpi_defaults(const EnvMap& env);

// SageMaker: SM_HOSTS (JSON list) sorted -> nnodes and master_addr (first host), index of
// SM_CURRENT_HOST in it -> node_rank, SM_NUM_GPUS if > 0 else SM_NUM_CPUS ->
// nproc_per_node, TRAINING_JOB_NAME -> job_id.
SchedulerDefaults sagemaker_defaults(const EnvMap& env);

// Generic: MASTER_ADDR and MASTER_PORT exported by the user or a job script.
SchedulerDefaults generic_defaults(const EnvMap& env);

// Field-by-field merge in precedence order: generic env, SLURM, Open MPI, SageMaker.
// `source` lists the contributing sources joined by '+'; the first error wins.
SchedulerDefaults merged_defaults(const EnvMap& env);

// Expands a SLURM hostlist ("node[01-03,07],gpu5" -> node01 node02 node03 node07 gpu5).
// Zero padding of range bounds is kept. Returns an empty vector if the text is malformed.
std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist);

// First host of a SLURM hostlist without expanding all of it; empty if malformed.
std::string first_slurm_host(const std::string& nodelist);

// Tasks on node `node` (0-based) from SLURM's compressed per-node counts
// (SLURM_TASKS_PER_NODE "2(x3),1" -> 2, 2, 2, 1); nullopt if malformed or `node` is
// outside the list. Also used by smp.init under srun (python/smp/launch_env.py).
std::optional<int> slurm_tasks_on_node(const std::string& counts, int node);

}  // namespace smp::launcher
