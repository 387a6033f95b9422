// What stopped a job: a rank that exited non-zero or was killed, a node whose launcher
// vanished, or a signal sent to a launcher. A Failure is a plain value; it travels between
// nodes as JSON (see Note [Control protocol] in control_channel.h) so that every node
// prints the same report.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace smp::launcher {

enum class FailureKind {
  kRankExit,        // a rank exited with a non-zero code or was killed by a signal
  kNodeLost,        // another node's launcher closed its connection or stopped heartbeating
  kLauncherSignal,  // a launcher received SIGINT/SIGTERM/SIGHUP and stopped the job
};

struct Failure {
  FailureKind kind = FailureKind::kRankExit;
  // Node of the failed rank, of the lost launcher, or of the signalled launcher.
  int node = 0;
  // kRankExit: global and local rank.
  int rank = -1;
  int local_rank = -1;
  // kRankExit: exit code if it exited, else 0.
  int exit_code = 0;
  // kRankExit: the signal that killed the rank; kLauncherSignal: the signal received.
  int signal = 0;
  // kNodeLost: why the node counts as lost ("connection closed", "no heartbeat for 5 s").
  std::string detail;
  // kNodeLost: which host and ranks that node had ("host 'h1', ranks 2-3"; empty when
  // not known).
  std::string where;
  // kRankExit: the last lines of the rank's output (unprefixed).
  std::vector<std::string> tail;

  static Failure rank_exit(int node, int rank, int local_rank, int wait_status,
                           std::vector<std::string> tail);
  static Failure node_lost(int node, std::string detail, std::string where = "");
  // "host 'NAME', ranks A-B" for node `node` of a job of `nproc` ranks a node.
  static std::string node_place(const std::string& host, int node, int nproc);
  static Failure launcher_signal(int node, int sig);

  // A failed rank and a lost node are restarted by --max_restarts (a lost node once it
  // has joined again, Note [Rejoining after a lost node]); a signal ends the job.
  bool restartable() const { return kind != FailureKind::kLauncherSignal; }
  // Exit status of every launcher when this failure ends the job: 128+sig for a signal to
  // a launcher, else kExitFailure (1).
  int job_exit_code() const;
  // One line, e.g. "rank 2 (node 0, local rank 2) exited with code 7".
  std::string describe() const;
  // The full report: what failed first, then the tail of its output, each line ready to print.
  std::vector<std::string> report_lines() const;

  nlohmann::json to_json() const;
  // Throws nlohmann::json::exception on a malformed message.
  static Failure from_json(const nlohmann::json& j);
};

// "SIGKILL" for 9; "signal 77" for unknown numbers.
std::string signal_name(int sig);

}  // namespace smp::launcher
