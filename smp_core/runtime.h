// Process-wide smp state after init: config, topology, store and process groups.
//
// Two ways in: smp::init() for C++ programs (reads the launcher's env, creates a
// TCPStore and Gloo groups itself), and the Python package, which creates the groups
// through torch.distributed (so they are registered there) and hands them over with
// install(). Both go through agree_config() first, so every rank fails alike on a bad
// or differing config and none hangs.
//
// Thread-safety: init/install/shutdown from one thread; getters are safe afterwards.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "smp_core/comm.h"
#include "smp_core/config.h"
#include "smp_core/topology.h"

namespace smp {

// Where this process sits, from the variables smprun and torchrun set: RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and
// TORCHELASTIC_RUN_ID). The one parser of them: smp::init (C++) reads the process's
// environment, and Python's smp.init (python/smp/launch_env.py, bound as
// `_C.process_env`) reads them through it too.
//
// With RANK set: RANK and WORLD_SIZE are required; LOCAL_RANK defaults to RANK,
// LOCAL_WORLD_SIZE to WORLD_SIZE; with WORLD_SIZE > 1, MASTER_ADDR defaults to
// 127.0.0.1 and MASTER_PORT is required (except under torchrun, whose agent hosts the
// store). Without RANK: a world of 1, unless OMPI_COMM_WORLD_* or SLURM_* say this is
// one of several ranks (then ConfigError: smp::init reads only the variables above;
// Python's smp.init derives them from Open MPI's and SLURM's own, launch_env.py).
// Errors are ConfigError naming the variable and its value.
struct ProcessEnv {
  // This process's global rank (RANK).
  int rank = 0;
  // Ranks in the job (WORLD_SIZE).
  int world_size = 1;
  // Rank on this node (LOCAL_RANK; default: rank).
  int local_rank = 0;
  // Ranks on this node (LOCAL_WORLD_SIZE; default: world_size).
  int local_size = 1;
  // Rank 0's host (MASTER_ADDR; default 127.0.0.1). Read only when world_size > 1.
  std::string master_addr = "127.0.0.1";
  // Rank 0's store port (MASTER_PORT); 0: none needed (a world of 1, or torchrun's).
  int master_port = 0;
  // TORCHELASTIC_RUN_ID is set: torchrun started this process and its agent hosts the
  // store on MASTER_PORT.
  bool torchelastic = false;

  // Parses the process's environment.
  static ProcessEnv from_environment();
  // Parses `vars` (variable -> value) as from_environment parses the environment.
  static ProcessEnv from_variables(const std::map<std::string, std::string>& vars);
};

// The integer in environment variable `name`, or `def` when it is unset or empty;
// `vars` instead of the process's environment when given. Surrounding blanks are
// allowed. Throws ConfigError "smp: environment NAME='value' is not an integer".
int env_int(const std::string& name, int def,
            const std::map<std::string, std::string>* vars = nullptr);

// Note [Fixed mmap threshold]: glibc's malloc serves a block from its heap once a larger
// block was freed (its mmap threshold follows the largest freed block, up to 32 MiB),
// and a heap page stays resident while anything sits above it; each thread has its own
// heap. Training allocates and frees tensors of a few MiB on several threads (forward
// and backward on the pipeline's task threads, the optimizer's temporaries on the main
// thread), so freed blocks of one thread's heap stay resident while another thread's
// heap grows: +400-650 MB per rank over its training state at pp=4 for a 285M-parameter
// GPT (bench/memory.py). A fixed threshold (mallopt M_MMAP_THRESHOLD) maps every block
// of at least `bytes` on its own and unmaps it when freed. Fixing it also fixes the
// trim threshold (glibc's would stay at 128 KiB, and the heap would give back and
// fault in again its top every step: a pp=2 step 1.5x slower), so it is set to
// 4 x `bytes`, glibc's own ratio. At 4 MiB: the head rank of that GPT at 1.26 x its
// state and activations instead of 1.49, and bench/pipeline's steps as fast as with
// the tuned allocator. Returns false where the C library is not glibc (nothing done)
// or mallopt refused.
bool set_malloc_mmap_threshold(size_t bytes);

// Exchanges each rank's raw config JSON over `store`, parses it, and returns the
// resolved Config if every rank's config is valid and identical; else throws the same
// ConfigError on every rank (naming the key and which ranks hold which value).
Config agree_config(const StorePtr& store, const ProcessEnv& env, const std::string& raw_json);

// Resolves the config text of a bare smp::init(): SMP_CONFIG, else
// SM_HP_MP_PARAMETERS, else "{}".
std::string config_from_environment();

struct Groups {
  ProcessGroupPtr world, pp, dp;
  // Only with tensor parallelism (tp > 1); with tp = 1, mp is pp, rdp is dp and a tp
  // group is this rank alone (Note [Groups under tensor parallelism], topology.cpp).
  ProcessGroupPtr tp, rdp, mp;
};

class Runtime {
 public:
  Runtime(Config config, ProcessEnv env, StorePtr store, Groups groups);
  ~Runtime();

  const Config& config() const { return config_; }
  const Topology& topology() const { return topology_; }
  const ProcessEnv& env() const { return env_; }
  int rank() const { return env_.rank; }
  int pp_rank() const { return topology_.pp_rank(env_.rank); }
  int dp_rank() const { return topology_.dp_rank(env_.rank); }
  const Groups& groups() const { return groups_; }
  const StorePtr& store() const { return store_; }
  StoreMailbox& mailbox() { return *mailbox_; }
  // A new Gloo group of `members` (global ranks, in group order), made on the store
  // under `name` (unique in the job); collective over the members only; null on every
  // other rank. Bound like smp's own groups (the user's GLOO_SOCKET_IFNAME, else Note
  // [Gloo's interface]).
  ProcessGroupPtr make_group(const std::string& name, const std::vector<int>& members) const;

 private:
  Config config_;
  ProcessEnv env_;
  Topology topology_;
  StorePtr store_;
  Groups groups_;
  std::unique_ptr<StoreMailbox> mailbox_;
};

// Installs the process-wide runtime (Python path). Throws if already initialized.
Runtime& install(Config config, ProcessEnv env, StorePtr store, Groups groups);

// C++ path: init from the environment and `config_json` (empty: from the environment).
Runtime& init(const std::string& config_json = "");
// C++ path with a Config value.
Runtime& init(const Config& config);

bool is_initialized();
// The runtime; throws std::runtime_error "smp: not initialized" before init.
Runtime& runtime();
// Drops the runtime and its groups (tests; re-init afterwards is allowed).
void shutdown();

}  // namespace smp
