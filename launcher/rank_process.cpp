#include "launcher/rank_process.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>

namespace smp::launcher {

std::vector<int> usable_cpu_list() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  if (cpus.empty()) {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    for (int c = 0; c < std::max(1L, n); ++c) cpus.push_back(c);
  }
  return cpus;
}

int usable_cores() { return static_cast<int>(usable_cpu_list().size()); }

std::vector<int> rank_cpu_block(const std::vector<int>& cpus, int nproc, int local_rank) {
  const int n = static_cast<int>(cpus.size());
  if (nproc < 1 || n < nproc || local_rank < 0 || local_rank >= nproc) return {};
  const int base = n / nproc, extra = n % nproc;
  const int begin = local_rank * base + std::min(local_rank, extra);
  const int size = base + (local_rank < extra ? 1 : 0);
  return std::vector<int>(cpus.begin() + begin, cpus.begin() + begin + size);
}

std::string bind_cores_error(const std::vector<int>& cpus, int nproc) {
  if (static_cast<int>(cpus.size()) >= nproc) return "";
  return "--bind_cores needs a CPU per rank: --nproc_per_node " + std::to_string(nproc) +
         " ranks, but smprun may use " + std::to_string(cpus.size()) +
         " CPUs (allowed: --nproc_per_node <= " + std::to_string(cpus.size()) +
         ", or no --bind_cores)";
}

EnvMap rank_environment(const EnvMap& base, const LaunchOptions& o, int local_rank, int attempt,
                        int master_port, int cores) {
  EnvMap env = base;
  env["RANK"] = std::to_string(global_rank(o, local_rank));
  env["WORLD_SIZE"] = std::to_string(o.nnodes * o.nproc_per_node);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["LOCAL_WORLD_SIZE"] = std::to_string(o.nproc_per_node);
  env["NODE_RANK"] = std::to_string(o.node_rank);
  env["MASTER_ADDR"] = o.master_addr;
  env["MASTER_PORT"] = std::to_string(master_port);
  env["SMP_RESTART_COUNT"] = std::to_string(attempt);
  // Note [Rank heartbeat] (smp_core/liveness.cpp): smprun's launchers watch the hosts.
  env["SMP_LAUNCHER"] = "smprun";
  // Note [Job secret]: every rank holds the job's secret, in its environment only.
  env["SMP_JOB_SECRET"] = o.secret;
  env.erase("SMP_JOB_SECRET_FILE");
  if (!o.config_json.empty()) env["SMP_CONFIG"] = o.config_json;
  if (!o.checkpoint_dir.empty()) env["SMP_CHECKPOINT_DIR"] = o.checkpoint_dir;
  std::string threads = std::to_string(std::max(1, cores / std::max(1, o.nproc_per_node)));
  for (const char* key : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"}) {
    if (base.find(key) == base.end()) env[key] = threads;
  }
  if (base.find("PYTHONUNBUFFERED") == base.end()) env["PYTHONUNBUFFERED"] = "1";
  return env;
}

std::string add_smp_package_path(const std::string& exe_path, EnvMap& env) {
#ifdef SMP_LAUNCHER_IN_WHEEL
  // pip installed this smprun with its smp into the interpreter's site-packages: a
  // `make install` tree in the same prefix (pip and make both default to /usr/local)
  // must not shadow that smp through PYTHONPATH.
  (void)exe_path;
  (void)env;
  return "";
#endif
  std::string bin = exe_path.substr(0, exe_path.find_last_of('/'));
  for (const char* rel : {"/../python", "/../lib/smp/python"}) {
    std::string dir = bin + rel;
    if (access((dir + "/smp/__init__.py").c_str(), R_OK) != 0) continue;
    auto it = env.find("PYTHONPATH");
    env["PYTHONPATH"] = it == env.end() || it->second.empty() ? dir : dir + ":" + it->second;
    return dir;
  }
  return "";
}

pid_t spawn_rank(const std::vector<std::string>& argv, const EnvMap& env, int out_fd, int err_fd,
                 std::string* error, const std::vector<int>& cpus) {
  cpu_set_t bound;  // Note [Core binding]
  CPU_ZERO(&bound);
  for (int c : cpus) CPU_SET(c, &bound);
  // Build everything before fork: the child only calls async-signal-safe functions.
  std::vector<std::string> env_strings;
  env_strings.reserve(env.size());
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = argv;
  std::vector<char*> argp;
  for (auto& s : args) argp.push_back(s.data());
  argp.push_back(nullptr);
  std::string exec_error = "smprun: cannot execute '" + argv[0] + "': ";
  pid_t parent = getpid();

  pid_t pid = fork();
  if (pid < 0) {
    *error = std::string("fork failed: ") + std::strerror(errno);
    return -1;
  }
  if (pid > 0) {
    setpgid(pid, pid);  // also done in the child: whichever runs first wins the race
    return pid;
  }
  // Child.
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(1);  // the launcher died before prctl took effect
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE}) signal(sig, SIG_DFL);
  // Note [Core binding]: before exec, so every thread of the rank inherits it.
  if (!cpus.empty()) sched_setaffinity(0, sizeof(bound), &bound);
  int devnull = open("/dev/null", O_RDONLY);
  if (devnull >= 0) dup2(devnull, 0);
  dup2(out_fd, 1);
  dup2(err_fd, 2);
  // Launcher fds are close-on-exec; the pipe ends dup'ed to 1 and 2 are not.
  // execvpe searches PATH in the launcher's environment.
  execvpe(argp[0], argp.data(), envp.data());
  int err = errno;
  ssize_t ignored = write(2, exec_error.data(), exec_error.size());
  const char* text = strerror(err);
  ignored = write(2, text, strlen(text));
  ignored = write(2, "\n", 1);
  (void)ignored;
  _exit(127);
}

}  // namespace smp::launcher
