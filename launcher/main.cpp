// smprun: the launcher executable. Parses the command line (options.h), resolves the
// port, and runs this node's Session: the coordinator on node 0, a worker elsewhere.
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "launcher/line_buffer.h"
#include "launcher/net.h"
#include "launcher/rank_process.h"
#include "launcher/options.h"
#include "launcher/session.h"
#include "launcher/signals.h"
#include "smp_common/env.h"

namespace {

using namespace smp::launcher;

int fail(int code, const std::string& message) {
  write_all(STDERR_FILENO, "smprun: error: " + message + "\n");
  return code;
}

// mkdir -p; "" or an error message.
std::string make_dirs(const std::string& path) {
  std::string prefix;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    prefix = path.substr(0, pos);
    if (prefix.empty()) continue;
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
      return "cannot create --log_dir '" + path + "': " + std::strerror(errno);
  }
  struct stat st {};
  if (stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return "--log_dir '" + path + "' is not a directory";
  if (access(path.c_str(), W_OK) != 0) return "--log_dir '" + path + "' is not writable";
  return "";
}

int run(int argc, char** argv) {
  EnvMap env = smp::common::current_env();
  char exe[4096];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  const std::string exe_path = n > 0 ? std::string(exe, static_cast<size_t>(n)) : "";
  // smprun installed into a Python environment runs .py programs with its python.
  if (env.count("SMP_PYTHON") == 0 || env["SMP_PYTHON"].empty()) {
    std::string python = environment_python(exe_path);
    if (!python.empty()) env["SMP_PYTHON"] = python;
  }
  ParseResult parsed = parse_options(std::vector<std::string>(argv, argv + argc), env);
  if (parsed.status == -1) {
    write_all(STDOUT_FILENO, parsed.help);
    return 0;
  }
  if (parsed.status != 0) return fail(kExitBadInput, parsed.error);
  const LaunchOptions& options = parsed.options;
  if (!exe_path.empty()) add_smp_package_path(exe_path, env);
  if (!options.log_dir.empty()) {
    std::string error = make_dirs(options.log_dir);
    if (!error.empty()) return fail(kExitBadInput, error);
  }
  std::string error = check_master_port(options);
  if (!error.empty()) return fail(kExitBadInput, error);
  if (options.bind_cores) {
    error = bind_cores_error(usable_cpu_list(), options.nproc_per_node);
    if (!error.empty()) return fail(kExitBadInput, error);
  }
  int port = options.master_port;
  if (port == 0) {
    port = pick_free_port(options.master_addr, &error);
    if (port == 0) return fail(kExitFailure, "cannot pick a free port: " + error);
  }
  SignalPipe::install();
  // Orphaned grandchildren of the ranks are re-parented to us, so we can reap them.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  auto session = options.node_rank == 0 ? make_coordinator(options, env, port)
                                        : make_worker(options, env, port);
  return session->run();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    // Ranks die with us (PR_SET_PDEATHSIG).
    return fail(kExitFailure, std::string("internal error: ") + e.what());
  }
}
