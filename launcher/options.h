// smprun's command line: parsing (CLI11), scheduler defaults, validation.
//
// parse_options() never exits or prints: it returns either options ready to launch, the
// help text, or one error message that main() prints as `smprun: error: <message>` with
// exit code 2 (kExitBadInput). It reads only the arguments and EnvMap it is given, plus
// the file system for --config files and the program (so tests pass an EnvMap). Checks
// that need the network (port in use) are in check_master_port().
#pragma once

#include <string>
#include <vector>

#include "launcher/scheduler_env.h"

namespace smp::launcher {

// Exit status of smprun for bad input (unknown flag, missing program, bad values).
constexpr int kExitBadInput = 2;
// Exit status of smprun when a rank or a node failed.
constexpr int kExitFailure = 1;
// Python interpreter for .py programs when SMP_PYTHON is unset (the one that has torch).
#ifdef SMP_DEFAULT_PYTHON
constexpr const char* kDefaultPython = SMP_DEFAULT_PYTHON;
#else
constexpr const char* kDefaultPython = "/usr/bin/python3";
#endif

struct LaunchOptions {
  // Nodes in the job; one smprun runs on each.
  int nnodes = 1;
  // This node's index in [0, nnodes); node 0 runs the coordinator.
  int node_rank = 0;
  // Ranks started on each node; global rank = node_rank * nproc_per_node + local rank.
  int nproc_per_node = 1;
  // Address of node 0 (MASTER_ADDR of every rank); 127.0.0.1 on a single node.
  std::string master_addr = "127.0.0.1";
  // MASTER_PORT of every rank; the coordinator listens on master_port + 1. 0 = pick a free
  // port on 127.0.0.1 (single node only).
  int master_port = 0;
  // True when the port came from a flag or the environment (then node 0 checks it is free).
  bool master_port_given = false;
  // Compact JSON object passed as SMP_CONFIG; empty = --config not given (SMP_CONFIG unset).
  std::string config_json;
  // One file per rank, DIR/rank_<r>.log, without prefixes; empty = no files.
  std::string log_dir;
  // With log_dir: also print rank output on the console.
  bool tee = false;
  // Whole-job restarts after a rank failure (SMP_RESTART_COUNT = 0, 1, ...).
  int max_restarts = 0;
  // Seconds a node waits for the others to join (rendezvous).
  double rdzv_timeout_s = 60;
  // Seconds between SIGTERM and SIGKILL when ranks are stopped.
  double grace_period_s = 3;
  // Seconds without a message after which a peer launcher counts as dead.
  double heartbeat_timeout_s = 5;
  // Job identity checked in the multi-node handshake.
  std::string job_id = "smp";
  // argv of each rank: interpreter (for .py), program, then the user's arguments untouched.
  std::vector<std::string> command;
  // Which scheduler environments contributed defaults (for messages); may be empty.
  std::string defaults_source;
  // The job secret (Note [Job secret] in smp_common/auth.h), hex: from --secret_file,
  // else SMP_JOB_SECRET, else SMP_JOB_SECRET_FILE, else drawn here (one node only).
  // Every rank gets it as SMP_JOB_SECRET; the launchers prove it to each other.
  std::string secret;
  // True when this smprun drew the secret (nobody supplied one).
  bool secret_drawn = false;
  // Where the job saves its checkpoints and resumes from after a restart (Note
  // [Automatic resume] in python/smp/auto_resume.py); passed as SMP_CHECKPOINT_DIR
  // (absolute). Empty: not given.
  std::string checkpoint_dir;
  // Note [Core binding] (launcher/rank_process.h): each local rank runs on its own block
  // of the CPUs this launcher may use (--bind_cores).
  bool bind_cores = false;
};

struct ParseResult {
  // 0: launch with `options`; kExitBadInput: `error` holds the message; -1: print `help`
  // and exit 0.
  int status = 0;
  LaunchOptions options;
  std::string error;
  std::string help;
};

// Parses argv (argv[0] is the program name) against `env`.
ParseResult parse_options(const std::vector<std::string>& argv, const EnvMap& env);

// Sets options->secret (Note [Job secret]): the file `secret_file` (--secret_file),
// else SMP_JOB_SECRET, else the file SMP_JOB_SECRET_FILE of `env`; else one drawn now
// when options->nnodes is 1. Returns an error message (unreadable, malformed, or none
// for several nodes) or "".
std::string resolve_secret(const std::string& secret_file, const EnvMap& env, LaunchOptions* options);

// Validates `options` (ranges, program, nodes); returns an error message or "".
std::string validate_options(const LaunchOptions& options);

// Parses --config: a path to an existing JSON file or inline JSON; must be a JSON object.
// On success returns true and sets *json to its compact form; else sets *error.
bool load_config(const std::string& value, std::string* json, std::string* error);

// Resolves PROGRAM: .py -> {python, program}; otherwise an executable path or a name on
// PATH. Returns "" and sets *argv, or an error message.
// The interpreter of the Python environment (venv or conda) whose bin/ holds `exe`, the
// smprun being run, as after `pip install .`; "" when `exe` is not in one.
std::string environment_python(const std::string& exe);

std::string resolve_program(const std::string& program, const EnvMap& env,
                            std::vector<std::string>* argv);

// On node 0 with a given port: checks master_port (and the control port master_port + 1
// when nnodes > 1) can be bound on master_addr. Returns an error message or "".
std::string check_master_port(const LaunchOptions& options);

}  // namespace smp::launcher
