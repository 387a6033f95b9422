// Starting one rank: its environment (pure, unit-tested) and the fork/exec that puts it in
// a process group of its own, so stopping a rank can signal its grandchildren too, and
// optionally on CPUs of its own (Note [Core binding]).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "launcher/options.h"
#include "launcher/scheduler_env.h"

namespace smp::launcher {

// How many CPUs this launcher may run on: usable_cpu_list()'s size, at least 1.
int usable_cores();

// Note [Core binding]
// ~~~~~~~~~~~~~~~~~~~
// With --bind_cores each local rank runs on a block of its own of the CPUs this
// launcher may use, as DeepSpeed's --bind_cores_to_rank does: rank l gets the l-th of
// nproc_per_node contiguous blocks, the first (cpus % nproc) one CPU larger. A rank's
// threads (its compute, its receiving thread, its collectives' threads) then stay on
// its own cores, so one rank's wake-ups do not preempt another rank's compute: at pp=2
// on 2 cores that made bench/pipeline.py's step ~7% faster, for smp and the torch peer
// alike (the bench binds both). The affinity is set in the child before exec, so every
// thread the rank starts inherits it. Fewer CPUs than ranks is an error at launch.
//
// The CPUs this launcher may run on (sched_getaffinity; else 0 .. the CPUs online - 1),
// in increasing order, at least one.
std::vector<int> usable_cpu_list();
// Local rank `local_rank`'s block of `cpus` among `nproc` ranks (empty if there are
// fewer CPUs than ranks: bind_cores_error says so).
std::vector<int> rank_cpu_block(const std::vector<int>& cpus, int nproc, int local_rank);
// "" or why --bind_cores cannot give `nproc` ranks a CPU each among `cpus`.
std::string bind_cores_error(const std::vector<int>& cpus, int nproc);

// The environment of local rank `local_rank` in restart `attempt`: `base` (the launcher's
// environment) plus RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK,
// MASTER_ADDR, MASTER_PORT (`master_port`, the resolved port), SMP_RESTART_COUNT,
// SMP_CONFIG (only when options.config_json is set), and, unless `base` sets them,
// OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = max(1, cores / nproc_per_node) and
// PYTHONUNBUFFERED=1 (so output reaches the launcher line by line).
EnvMap rank_environment(const EnvMap& base, const LaunchOptions& options, int local_rank,
                        int attempt, int master_port, int cores);

// Prepends to PYTHONPATH in `env` the `smp` package that ships with the launcher at
// `exe_path` (the build tree's <bin>/../python, or an install's <bin>/../lib/smp/python),
// so `import smp` works in the ranks without setting PYTHONPATH by hand. Returns the
// directory added, or "" when neither holds smp/__init__.py, and always "" in smprun
// built by `pip install .` (SMP_LAUNCHER_IN_WHEEL), whose smp is in site-packages.
std::string add_smp_package_path(const std::string& exe_path, EnvMap& env);

// Global rank of a local rank.
inline int global_rank(const LaunchOptions& o, int local_rank) {
  return o.node_rank * o.nproc_per_node + local_rank;
}

// Forks and execs argv[0] (PATH lookup if it has no '/') with `env`; stdin is /dev/null,
// stdout/stderr are out_fd/err_fd (the write ends of the launcher's pipes). The child
// starts its own process group (pgid == pid), gets PR_SET_PDEATHSIG=SIGKILL (it dies if
// the launcher dies), default signal dispositions and an empty signal mask. If exec fails
// the child prints "smprun: cannot execute ..." on err_fd and exits 127. Returns the pid,
// or -1 and *error if fork failed.
// `cpus`: where not empty, the child runs on these CPUs only (Note [Core binding]).
pid_t spawn_rank(const std::vector<std::string>& argv, const EnvMap& env, int out_fd, int err_fd,
                 std::string* error, const std::vector<int>& cpus = {});

}  // namespace smp::launcher
