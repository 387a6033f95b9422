#include "launcher/options.h"

#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "launcher/net.h"
#include "smp_common/auth.h"
#include "smp_common/env.h"

namespace smp::launcher {

namespace {

constexpr const char* kFooter = R"(
Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR,
MASTER_PORT, SMP_RESTART_COUNT, SMP_CONFIG (only with --config), and OMP_NUM_THREADS /
OPENBLAS_NUM_THREADS = max(1, cores / nproc_per_node) unless already set. A PROGRAM ending
in .py runs with $SMP_PYTHON (default: the python of the virtual environment smprun is
installed in, else the Python smp was built for). Output lines are
prefixed with the global rank, e.g. "[3] ...". Defaults come from SLURM, Open MPI or
SageMaker environment variables when present; flags win. Node 0 coordinates a multi-node
job on control port master_port + 1. Exit status: 0 all ranks succeeded, 1 a rank or node
failed, 2 bad input, 128+N stopped by signal N. See docs/launcher.md.)";

// CLI11 2.1 has no App::usage(): print the PROGRAM [ARGS...] tail ourselves.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string name) const override {
    return "Usage: " + name + " [OPTIONS] PROGRAM [ARGS...]\n";
  }
};

bool is_file(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

constexpr const char* kConfigAccepted =
    "accepted: a JSON object like {\"partitions\": 2}, or the path of an existing JSON file";

// Whether a --config value is meant as inline JSON rather than a path.
bool looks_like_json(const std::string& value) {
  size_t first = value.find_first_not_of(" \t\r\n");
  return first != std::string::npos && (value[first] == '{' || value[first] == '[');
}

}  // namespace

bool load_config(const std::string& value, std::string* json, std::string* error) {
  std::string text = value;
  std::string what = "--config value";
  struct stat st {};
  if (!looks_like_json(value) && !nlohmann::json::accept(value)) {
    if (stat(value.c_str(), &st) != 0) {
      *error = "--config file '" + value + "' does not exist (" + kConfigAccepted + ")";
      return false;
    }
    if (!S_ISREG(st.st_mode)) {
      *error = "--config path '" + value + "' is not a regular file (" + kConfigAccepted + ")";
      return false;
    }
  }
  if (is_file(value)) {
    std::ifstream in(value);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!in) {
      *error = "--config: cannot read file '" + value + "'";
      return false;
    }
    text = ss.str();
    what = "--config file '" + value + "'";
  }
  nlohmann::json parsed;
  try {
    parsed = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    std::string detail = e.what();
    size_t colon = detail.find(": ");  // drop nlohmann's "[json.exception.parse_error.101] "
    if (detail.rfind("[json.exception", 0) == 0 && colon != std::string::npos)
      detail = detail.substr(detail.find(' ') + 1);
    *error = what + " is not an existing file nor valid JSON: " + detail + " (" +
             kConfigAccepted + ")";
    return false;
  }
  if (!parsed.is_object()) {
    *error = what + " must be a JSON object like {\"partitions\": 2}, got " +
             std::string(parsed.type_name());
    return false;
  }
  *json = parsed.dump();
  return true;
}

std::string environment_python(const std::string& exe) {
  size_t slash = exe.rfind('/');
  if (slash == std::string::npos) return "";
  const std::string bin = exe.substr(0, slash);
  const std::string prefix = bin.substr(0, bin.rfind('/') == std::string::npos ? 0 : bin.rfind('/'));
  struct stat st {};
  const bool is_env = stat((prefix + "/pyvenv.cfg").c_str(), &st) == 0 ||
                      stat((prefix + "/conda-meta").c_str(), &st) == 0;
  const std::string python = bin + "/python";
  return is_env && access(python.c_str(), X_OK) == 0 ? python : "";
}

std::string resolve_program(const std::string& program, const EnvMap& env,
                            std::vector<std::string>* argv) {
  argv->clear();
  if (ends_with(program, ".py")) {
    if (!is_file(program)) return "program '" + program + "' not found";
    auto it = env.find("SMP_PYTHON");
    std::string python = it != env.end() && !it->second.empty() ? it->second : kDefaultPython;
    if (access(python.c_str(), X_OK) != 0)
      return "Python interpreter '" + python + "' is not executable (set SMP_PYTHON)";
    *argv = {python, program};
    return "";
  }
  std::string path = program;
  if (program.find('/') == std::string::npos) {
    auto it = env.find("PATH");
    std::string dirs = it != env.end() ? it->second : "/usr/bin:/bin";
    path.clear();
    std::stringstream ss(dirs);
    std::string dir;
    while (std::getline(ss, dir, ':')) {
      std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
      if (is_file(candidate) && access(candidate.c_str(), X_OK) == 0) {
        path = candidate;
        break;
      }
    }
    if (path.empty()) return "program '" + program + "' not found on PATH";
  } else if (!is_file(program)) {
    return "program '" + program + "' not found";
  } else if (access(program.c_str(), X_OK) != 0) {
    return "program '" + program + "' is not executable (and not a .py script)";
  }
  *argv = {path};
  return "";
}

// Note [Job secret] (smp_common/auth.h): where the job's secret comes from.
std::string resolve_secret(const std::string& secret_file, const EnvMap& env, LaunchOptions* o) {
  auto get = [&](const char* key) {
    auto it = env.find(key);
    return it == env.end() ? std::string() : it->second;
  };
  try {
    if (!secret_file.empty()) {
      o->secret = auth::secret_from_file(secret_file, "--secret_file");
    } else if (!get(auth::kSecretEnv).empty()) {
      o->secret = get(auth::kSecretEnv);
      auth::key_from_secret(o->secret, auth::kSecretEnv);  // validates
    } else if (!get(auth::kSecretFileEnv).empty()) {
      o->secret = auth::secret_from_file(get(auth::kSecretFileEnv), auth::kSecretFileEnv);
    }
  } catch (const std::invalid_argument& e) {
    std::string what = e.what();
    return what.rfind("smp: ", 0) == 0 ? what.substr(5) : what;
  }
  if (o->secret.empty()) {
    if (o->nnodes > 1)
      return "a job on " + std::to_string(o->nnodes) + " nodes needs a secret shared by every "
             "node's smprun: export SMP_JOB_SECRET=<hex> (e.g. `openssl rand -hex 32`) on each "
             "node, or pass --secret_file PATH on a file system they share";
    o->secret = auth::to_hex(auth::random_bytes(auth::kKeyBytes));
    o->secret_drawn = true;
  }
  return "";
}

std::string validate_options(const LaunchOptions& o) {
  if (o.nnodes < 1) return "--nnodes must be >= 1, got " + std::to_string(o.nnodes);
  if (o.nproc_per_node < 1)
    return "--nproc_per_node must be >= 1, got " + std::to_string(o.nproc_per_node);
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    return "--node_rank " + std::to_string(o.node_rank) + " is not in [0, " +
           std::to_string(o.nnodes) + ") for --nnodes " + std::to_string(o.nnodes);
  int max_port = o.nnodes > 1 ? 65534 : 65535;  // the control port is master_port + 1
  if (o.master_port < 0 || o.master_port > max_port || (o.master_port == 0 && o.nnodes > 1))
    return "--master_port " + std::to_string(o.master_port) + " is not in [1, " +
           std::to_string(max_port) + "]";
  if (o.max_restarts < 0)
    return "--max_restarts must be >= 0, got " + std::to_string(o.max_restarts);
  if (!(o.rdzv_timeout_s > 0)) return "--rdzv_timeout must be > 0 seconds";
  if (!(o.grace_period_s >= 0)) return "--grace_period must be >= 0 seconds";
  if (!(o.heartbeat_timeout_s > 0)) return "--heartbeat_timeout must be > 0 seconds";
  if (o.master_addr.empty()) return "--master_addr is empty";
  if (o.job_id.empty() || o.job_id.find_first_of(" \t\n") != std::string::npos)
    return "--job_id '" + o.job_id + "' must be non-empty without spaces";
  if (o.command.empty()) return "missing PROGRAM";
  return "";
}

std::string check_master_port(const LaunchOptions& o) {
  if (o.node_rank != 0 || !o.master_port_given) return "";
  std::string error;
  int fd = bind_tcp(o.master_addr, o.master_port, &error);
  if (fd < 0) return "--master_port " + std::to_string(o.master_port) + ": " + error;
  close(fd);
  if (o.nnodes > 1) {
    fd = bind_tcp(o.master_addr, o.master_port + 1, &error);
    if (fd < 0)
      return "control port (--master_port + 1) " + std::to_string(o.master_port + 1) + ": " + error;
    close(fd);
  }
  return "";
}

ParseResult parse_options(const std::vector<std::string>& argv, const EnvMap& env) {
  ParseResult r;
  LaunchOptions& o = r.options;
  CLI::App app{
      "Starts, watches and stops the ranks of an smp job on this node. ARGS go to PROGRAM "
      "untouched.",
      "smprun"};
  app.prefix_command();
  app.formatter(std::make_shared<UsageFormatter>());
  app.footer(kFooter);
  auto* nnodes = app.add_option("--nnodes", o.nnodes,
                                "Number of nodes; run one smprun per node (default 1 or scheduler)");
  auto* node_rank = app.add_option("--node_rank,--node-rank", o.node_rank,
                                   "This node's index in [0, nnodes); 0 coordinates (default 0)");
  auto* nproc = app.add_option("--nproc_per_node,--nproc-per-node", o.nproc_per_node,
                               "Ranks to start on this node (default 1 or scheduler)");
  auto* addr = app.add_option("--master_addr,--master-addr", o.master_addr,
                              "Address of node 0 (default 127.0.0.1 on one node)");
  auto* port = app.add_option("--master_port,--master-port", o.master_port,
                              "MASTER_PORT of the ranks; node 0's launcher listens on it + 1 "
                              "(default: a free port on one node, " +
                                  std::to_string(common::kDefaultMasterPort) + " on several)");
  std::string config;
  auto* config_opt =
      app.add_option("--config", config, "smp config: JSON text or a JSON file, passed as SMP_CONFIG");
  app.add_option("--log_dir,--log-dir", o.log_dir,
                 "Write each rank's output, unprefixed, to DIR/rank_<r>.log (console gets "
                 "none unless --tee)");
  app.add_flag("--tee", o.tee, "With --log_dir: also print rank output on the console");
  app.add_flag("--bind_cores,--bind-cores", o.bind_cores,
               "Bind each local rank to its own block of the CPUs smprun may use (like "
               "DeepSpeed's --bind_cores_to_rank): a rank's threads stay off its neighbours' "
               "cores (default off)");
  app.add_option("--max_restarts,--max-restarts", o.max_restarts,
                 "Restart the whole job up to K times after a rank fails (default 0)");
  app.add_option("--rdzv_timeout,--rdzv-timeout", o.rdzv_timeout_s,
                 "Seconds to wait for all nodes to join (default 60)");
  app.add_option("--grace_period,--grace-period", o.grace_period_s,
                 "Seconds between SIGTERM and SIGKILL when stopping ranks (default 3)");
  app.add_option("--heartbeat_timeout,--heartbeat-timeout", o.heartbeat_timeout_s,
                 "Seconds of silence after which another node's launcher is dead (default 5)");
  app.add_option("--checkpoint_dir,--checkpoint-dir", o.checkpoint_dir,
                 "Directory of the job's smp.save_checkpoint saves; a (re)started job resumes "
                 "from its newest complete one by itself (SMP_CHECKPOINT_DIR)");
  std::string secret_file;
  app.add_option("--secret_file,--secret-file", secret_file,
                 "File holding the job secret (hex, >= 32 digits) every node's smprun must share "
                 "(default: SMP_JOB_SECRET, SMP_JOB_SECRET_FILE, or one drawn per job on one node)");
  auto* job_id = app.add_option("--job_id,--job-id", o.job_id,
                                "Job identity all nodes must agree on (default: scheduler job id "
                                "or 'smp')");

  std::vector<std::string> args(argv.size() > 1 ? argv.begin() + 1 : argv.end(), argv.end());
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    r.status = -1;
    r.help = app.help();
    return r;
  } catch (const CLI::ParseError& e) {
    r.status = kExitBadInput;
    r.error = e.what();
    return r;
  }
  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty()) {
    r.status = kExitBadInput;
    r.error = "missing PROGRAM (usage: smprun [OPTIONS] PROGRAM [ARGS...]; see --help)";
    return r;
  }
  if (rest.front().size() > 1 && rest.front()[0] == '-') {
    r.status = kExitBadInput;
    r.error = "unknown option '" + rest.front() + "' (see --help)";
    return r;
  }

  // Note [Default precedence]: a flag wins; then MASTER_ADDR/MASTER_PORT from the
  // environment; then SLURM, Open MPI, SageMaker (merged_defaults); then built-ins.
  SchedulerDefaults d = merged_defaults(env);
  o.defaults_source = d.source;
  bool all_flags = nnodes->count() && node_rank->count() && nproc->count();
  if (!d.error.empty() && !all_flags) {
    r.status = kExitBadInput;
    r.error = d.error;
    return r;
  }
  if (!nnodes->count() && d.nnodes) o.nnodes = *d.nnodes;
  if (!node_rank->count() && d.node_rank) o.node_rank = *d.node_rank;
  if (!nproc->count() && d.nproc_per_node) o.nproc_per_node = *d.nproc_per_node;
  if (!job_id->count() && d.job_id) o.job_id = *d.job_id;
  if (!addr->count()) {
    // A single node needs only loopback, whatever host name the scheduler gives.
    auto env_addr = env.find("MASTER_ADDR");
    if (o.nnodes == 1) {
      o.master_addr = env_addr != env.end() && !env_addr->second.empty() ? env_addr->second
                                                                         : "127.0.0.1";
    } else if (d.master_addr) {
      o.master_addr = *d.master_addr;
    } else {
      r.status = kExitBadInput;
      r.error = "--master_addr is required with --nnodes " + std::to_string(o.nnodes) +
                " (no MASTER_ADDR or scheduler host list in the environment)";
      return r;
    }
  }
  o.master_port_given = port->count() > 0;
  if (!port->count()) {
    if (d.master_port) {
      o.master_port = *d.master_port;
      o.master_port_given = true;
    } else if (o.nnodes > 1) {
      o.master_port = common::kDefaultMasterPort;
      o.master_port_given = true;
    } else {
      o.master_port = 0;  // picked at launch, see LaunchOptions::master_port
    }
  } else if (o.master_port == 0) {
    r.status = kExitBadInput;
    r.error = "--master_port 0 is not in [1, 65535]";
    return r;
  }
  if (config_opt->count() && !load_config(config, &o.config_json, &r.error)) {
    r.status = kExitBadInput;
    return r;
  }
  r.error = resolve_program(rest.front(), env, &o.command);
  if (r.error.empty()) r.error = validate_options(o);
  if (r.error.empty()) r.error = resolve_secret(secret_file, env, &o);
  if (r.error.empty() && !o.checkpoint_dir.empty() && o.checkpoint_dir[0] != '/') {
    // Absolute, so that a rank that changes its directory still finds it.
    char cwd[4096];
    if (getcwd(cwd, sizeof cwd) != nullptr) o.checkpoint_dir = std::string(cwd) + "/" + o.checkpoint_dir;
  }
  if (!r.error.empty()) {
    r.status = kExitBadInput;
    return r;
  }
  o.command.insert(o.command.end(), rest.begin() + 1, rest.end());
  return r;
}

}  // namespace smp::launcher
